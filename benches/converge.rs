//! Convergence at scale: cold start to every QueuePolicy Ready for 1,000 policies (queue,
//! dead-letter exchange, dead-letter queue, binding each) through the operator's own reconcile,
//! with the Kubernetes API in memory, against the floor: a plain loop issuing the same
//! declarations on one lapin channel (and, in Policy mode, the same broker policies one PUT after
//! another on one HTTP connection). Then the steady state: the same 1,000 policies, unchanged,
//! reconciled again.
//!
//! `cargo bench --bench converge` against the local broker (QUEUEGUARD_BENCH_BROKER,
//! QUEUEGUARD_BENCH_MANAGEMENT, QUEUEGUARD_BENCH_POLICIES, QUEUEGUARD_BENCH_MODE=Policy|Arguments).
//! AMQP round trips are counted by a proxy in front of the broker that reads the client's method
//! frames. Ends with one `key=value` summary line.

mod common;

use common::{base64, rss_mib};
use futures::StreamExt;
use http::StatusCode;
use kube::Client;
use lapin::{
    Connection, ConnectionProperties, ExchangeKind,
    options::*,
    types::{AMQPValue, FieldTable},
};
use queueguard::{
    controller::{self, Context, FINALIZER},
    crd::QueuePolicy,
};
use serde_json::{Value, json};
use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::Instant,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Reconciles in flight at once, as the operator's Controller runs them
/// (QUEUEGUARD_BENCH_CONCURRENCY overrides, to see the trade-off).
fn concurrency() -> usize {
    env("QUEUEGUARD_BENCH_CONCURRENCY", &queueguard::controller::CONCURRENCY.to_string()).parse().unwrap()
}

fn env(key: &str, default: &str) -> String {
    std::env::var(key).unwrap_or_else(|_| default.to_owned())
}

/// The Kubernetes API in memory: Secrets, QueuePolicies (status patches applied), Events.
/// Objects are kept as JSON text, as an API server keeps them, so that what this process holds
/// for the API side stays small next to the operator's own memory.
#[derive(Clone, Default)]
struct FakeApi {
    secret: Value,
    policies: Arc<Mutex<HashMap<String, String>>>,
    requests: Arc<AtomicU64>,
}

impl FakeApi {
    fn answer(&self, method: &str, path: &str, body: &[u8]) -> (StatusCode, Value) {
        self.requests.fetch_add(1, Ordering::Relaxed);
        let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
        match (method, parts.as_slice()) {
            ("GET", ["api", "v1", "namespaces", _, "secrets", _]) => (StatusCode::OK, self.secret.clone()),
            ("PATCH", ["apis", "queueguard.io", "v1alpha1", "namespaces", _, "queuepolicies", name, "status"]) => {
                let patch: Value = serde_json::from_slice(body).unwrap();
                let mut policies = self.policies.lock().unwrap();
                let stored = policies.get_mut(*name).expect("known policy");
                let mut object: Value = serde_json::from_str(stored).unwrap();
                object["status"] = patch["status"].clone();
                *stored = object.to_string();
                (StatusCode::OK, object)
            }
            ("POST", ["apis", "events.k8s.io", "v1", "namespaces", _, "events"]) => {
                (StatusCode::CREATED, serde_json::from_slice(body).unwrap())
            }
            ("PATCH", ["apis", "events.k8s.io", "v1", "namespaces", _, "events", _]) => {
                (StatusCode::OK, serde_json::from_slice(body).unwrap_or(json!({})))
            }
            _ => (
                StatusCode::NOT_FOUND,
                json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 404, "reason": "NotFound", "message": format!("{method} {path}")}),
            ),
        }
    }

    fn client(&self) -> Client {
        let api = self.clone();
        common::client(move |method, path, body| api.answer(method, path, body))
    }
}

/// A TCP proxy in front of the broker that counts the AMQP method frames clients send: each is
/// a round trip for the synchronous methods the operator uses.
async fn counting_proxy(upstream: String) -> (u16, Arc<AtomicU64>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let methods = Arc::new(AtomicU64::new(0));
    let counter = methods.clone();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let (upstream, counter) = (upstream.clone(), counter.clone());
            tokio::spawn(async move {
                let server = tokio::net::TcpStream::connect(upstream).await.unwrap();
                // Frames are forwarded one by one: without NODELAY, Nagle would hold them back.
                let _ = (client.set_nodelay(true), server.set_nodelay(true));
                let (mut cr, mut cw) = client.into_split();
                let (mut sr, mut sw) = server.into_split();
                tokio::spawn(async move {
                    let _ = tokio::io::copy(&mut sr, &mut cw).await;
                });
                let mut header = [0u8; 8];
                if cr.read_exact(&mut header).await.is_err() || sw.write_all(&header).await.is_err() {
                    return;
                }
                loop {
                    let mut head = [0u8; 7];
                    if cr.read_exact(&mut head).await.is_err() {
                        return;
                    }
                    let size = u32::from_be_bytes([head[3], head[4], head[5], head[6]]) as usize;
                    let mut rest = vec![0u8; size + 1];
                    if cr.read_exact(&mut rest).await.is_err() {
                        return;
                    }
                    if head[0] == 1 {
                        counter.fetch_add(1, Ordering::Relaxed);
                    }
                    let mut frame = head.to_vec();
                    frame.extend_from_slice(&rest);
                    if sw.write_all(&frame).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (port, methods)
}

/// The policies' `expires` (4h), for the floor's identical declarations.
const EXPIRES_MS: i64 = 4 * 3_600_000;

fn policy(name: &str, queue: &str, mode: &str) -> Value {
    json!({
        "apiVersion": "queueguard.io/v1alpha1", "kind": "QueuePolicy",
        "metadata": {
            "name": name, "namespace": "bench", "generation": 1, "uid": format!("uid-{name}"),
            "finalizers": [FINALIZER], "resourceVersion": "1"
        },
        // Reconciled once, never renewed: `expires` outlasts the longest run (Policy mode at
        // 1,000 takes 40 minutes), so no queue expires mid-run.
        "spec": {"broker": {"secretRef": {"name": "rabbitmq"}}, "queue": {"name": queue, "settings": mode, "expires": "4h"}}
    })
}

async fn reconcile_all(ctx: &Arc<Context>, policies: Vec<QueuePolicy>) -> usize {
    futures::stream::iter(policies)
        .map(|p| {
            let ctx = ctx.clone();
            async move { controller::reconcile(Arc::new(p), ctx).await.is_ok() }
        })
        .buffer_unordered(concurrency())
        .filter(|ok| futures::future::ready(!*ok))
        .count()
        .await
}

#[tokio::main]
async fn main() {
    queueguard::tls::install_crypto_provider();
    let n: usize = env("QUEUEGUARD_BENCH_POLICIES", "1000").parse().unwrap();
    let mode = env("QUEUEGUARD_BENCH_MODE", "Policy");
    let broker_host = env("QUEUEGUARD_BENCH_BROKER_ADDR", "127.0.0.1:5672");
    let management = env("QUEUEGUARD_BENCH_MANAGEMENT", "http://127.0.0.1:15672");
    let (port, methods) = counting_proxy(broker_host.clone()).await;
    let via_proxy = format!("amqp://guest:guest@127.0.0.1:{port}/%2F");
    let run = format!("qgconv.{}", std::process::id());

    let api = FakeApi {
        secret: json!({
            "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "rabbitmq", "namespace": "bench"},
            "data": {
                "uri": base64(&via_proxy),
                "managementUri": base64(&format!("http://guest:guest@{}", management.trim_start_matches("http://"))),
            }
        }),
        ..Default::default()
    };
    let mut objects = Vec::new();
    for i in 0..n {
        let name = format!("p{i}");
        let value = policy(&name, &format!("{run}.op.{i}"), &mode);
        api.policies.lock().unwrap().insert(name, value.to_string());
        objects.push(serde_json::from_value::<QueuePolicy>(value).unwrap());
    }
    let ctx = Arc::new(Context::new(api.client(), "queueguard-bench"));
    // What the benchmark itself holds before the operator runs (policies, in-memory API, proxy).
    let baseline = rss_mib("VmRSS:");

    println!("converge: {n} QueuePolicies (settings {mode}), {} reconciles at a time", concurrency());
    let started = Instant::now();
    let failed = reconcile_all(&ctx, objects.clone()).await;
    let operator = started.elapsed();
    // Read one stored object at a time: the benchmark's own memory must not add to the peak.
    let (mut ready, mut reasons) = (0, HashMap::<String, usize>::new());
    for text in api.policies.lock().unwrap().values() {
        let object: Value = serde_json::from_str(text).unwrap();
        let conditions = object["status"]["conditions"].as_array().cloned().unwrap_or_default();
        match conditions.iter().find(|c| c["type"] == "Ready") {
            Some(r) if r["status"] == "True" => ready += 1,
            Some(r) => {
                let message: String = r["message"].as_str().unwrap_or("").chars().take(120).collect();
                *reasons.entry(format!("{}: {message}", r["reason"])).or_default() += 1;
            }
            None => {}
        }
    }
    for (reason, count) in &reasons {
        println!("  not ready ({count}): {reason}");
    }
    let cold_methods = methods.load(Ordering::Relaxed);
    // The trackers' snapshots count with the reconciles' requests.
    let mgmt = || ctx.shared.brokers.management_requests() + ctx.trackers.management_requests();
    let cold_mgmt = mgmt();
    let connections = ctx.shared.brokers.connections_opened() + ctx.trackers.connections_opened();
    // The declarations and the event subscription each have a connection of their own: a
    // connection-level close caused by one policy's operation must not silence the events.
    let open = |states: Vec<(String, bool)>| states.iter().filter(|(_, up)| *up).count();
    println!(
        "  operator cold start: {:.2}s, {ready}/{n} Ready, {failed} failed reconciles, {cold_methods} AMQP methods, {cold_mgmt} management requests, {connections} AMQP connection(s) opened, open now: {} for declarations, {} for events",
        operator.as_secs_f64(),
        open(ctx.shared.brokers.connection_states()),
        open(ctx.trackers.connection_states())
    );

    // Steady state: the same policies with the status the first pass wrote, as the operator's
    // watch cache would hold them.
    let steady_objects: Vec<QueuePolicy> = {
        let stored = api.policies.lock().unwrap();
        objects.iter().map(|p| serde_json::from_str(&stored[&p.metadata.name.clone().unwrap()]).unwrap()).collect()
    };
    drop(objects);
    let kube_before = api.requests.load(Ordering::Relaxed);
    let started = Instant::now();
    let steady_failed = reconcile_all(&ctx, steady_objects).await;
    let steady = started.elapsed();
    let steady_methods = methods.load(Ordering::Relaxed) - cold_methods;
    let steady_mgmt = mgmt() - cold_mgmt;
    let steady_kube = api.requests.load(Ordering::Relaxed) - kube_before;
    println!(
        "  operator steady state: {:.3}s, {steady_methods} AMQP methods, {steady_mgmt} management requests, {steady_kube} Kubernetes API requests, {steady_failed} failed",
        steady.as_secs_f64()
    );
    let rss = rss_mib("VmHWM:");
    let operator_rss = rss - baseline;
    println!(
        "  peak RSS {rss:.1} MiB; the operator's part, above the {baseline:.1} MiB the benchmark held before: {operator_rss:.1} MiB"
    );

    // The floor starts from the same empty broker: the operator's queues and policies go first.
    let conn = Connection::connect(&format!("amqp://guest:guest@{broker_host}/%2F"), ConnectionProperties::default())
        .await
        .unwrap();
    let http = reqwest::Client::new();
    let management = Management { http: &http, base: &management };
    remove(&conn, &management, (0..n).map(|i| (format!("{run}.op.{i}"), format!("queueguard.bench.p{i}")))).await;

    // The floor: the same declarations (and policies), one after another.
    let ch = conn.create_channel().await.unwrap();
    let durable = QueueDeclareOptions { durable: true, ..Default::default() };
    let policy_mode = mode == "Policy";
    let started = Instant::now();
    for i in 0..n {
        let queue = format!("{run}.floor.{i}");
        let (dlx, dlq) = (format!("{queue}.dlx"), format!("{queue}.dlq"));
        let exchange = ExchangeDeclareOptions { durable: true, ..Default::default() };
        ch.exchange_declare(dlx.as_str().into(), ExchangeKind::Direct, exchange, FieldTable::default()).await.unwrap();
        ch.queue_declare(dlq.as_str().into(), durable, FieldTable::default()).await.unwrap();
        ch.queue_bind(
            dlq.as_str().into(),
            dlx.as_str().into(),
            queue.as_str().into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
        let mut args = FieldTable::default();
        if !policy_mode {
            args.insert("x-expires".into(), AMQPValue::LongLongInt(EXPIRES_MS));
            args.insert("x-dead-letter-exchange".into(), AMQPValue::LongString(dlx.as_str().into()));
            args.insert("x-dead-letter-routing-key".into(), AMQPValue::LongString(queue.as_str().into()));
        }
        ch.queue_declare(queue.as_str().into(), durable, args).await.unwrap();
        if policy_mode {
            let definition =
                json!({"expires": EXPIRES_MS, "dead-letter-exchange": dlx, "dead-letter-routing-key": queue});
            management.put_policy(&format!("floor.p{i}"), &queue, definition).await;
        }
    }
    let floor = started.elapsed();
    let floor_calls = if policy_mode {
        format!("{} AMQP methods + {n} policy PUTs", n * 4)
    } else {
        format!("{} AMQP methods", n * 4)
    };
    println!("  floor (plain loop, one channel): {:.2}s, {floor_calls}", floor.as_secs_f64());
    let ratio = operator.as_secs_f64() / floor.as_secs_f64();
    println!("  ratio operator / floor = {ratio:.2}");
    remove(&conn, &management, (0..n).map(|i| (format!("{run}.floor.{i}"), format!("floor.p{i}")))).await;

    println!(
        "summary policies={n} mode={mode} operator_s={:.2} floor_s={:.2} ratio={ratio:.2} connections={connections} peak_rss_mib={rss:.1} operator_rss_mib={operator_rss:.1} ready={ready} cold_amqp_methods={cold_methods} cold_mgmt_requests={cold_mgmt} steady_s={:.3} steady_amqp_methods={steady_methods} steady_mgmt_requests={steady_mgmt} steady_kube_requests={steady_kube}",
        operator.as_secs_f64(),
        floor.as_secs_f64(),
        steady.as_secs_f64()
    );
}

/// The management API as the floor and the clean-up use it: plain requests, one client.
struct Management<'a> {
    http: &'a reqwest::Client,
    base: &'a str,
}

impl Management<'_> {
    async fn put_policy(&self, name: &str, queue: &str, definition: Value) {
        let body = json!({
            "pattern": format!("^{}$", regex::escape(queue)), "apply-to": "queues",
            "priority": queueguard::settings::POLICY_PRIORITY, "definition": definition,
        });
        let url = format!("{}/api/policies/%2F/{name}", self.base);
        let answer = self.http.put(url).basic_auth("guest", Some("guest")).json(&body).send().await.unwrap();
        assert!(answer.status().is_success(), "PUT policy {name}: {}", answer.status());
    }

    async fn delete_policy(&self, name: &str) {
        let url = format!("{}/api/policies/%2F/{name}", self.base);
        let _ = self.http.delete(url).basic_auth("guest", Some("guest")).send().await;
    }
}

/// Deletes each (queue, policy): queues, dead-letter queues and exchanges first, so that each
/// policy deletion has few queues left to re-match (the broker re-matches every queue of the
/// vhost on each policy change).
async fn remove(conn: &Connection, management: &Management<'_>, items: impl Iterator<Item = (String, String)>) {
    let ch = conn.create_channel().await.unwrap();
    let mut policies = Vec::new();
    for (queue, policy) in items {
        for q in [queue.clone(), format!("{queue}.dlq")] {
            let _ = ch.queue_delete(q.as_str().into(), QueueDeleteOptions::default()).await;
        }
        let _ = ch.exchange_delete(format!("{queue}.dlx").as_str().into(), ExchangeDeleteOptions::default()).await;
        policies.push(policy);
    }
    for policy in policies {
        management.delete_policy(&policy).await;
    }
}
