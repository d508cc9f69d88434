//! The gate at fleet scale: 1,000 workloads of 3 pods, each guarded by one QueuePolicy, and 100
//! workers of 3 pods each guarded by 3 policies (1,300 policies, 1,100 workloads, a third of them
//! StatefulSets and the rest Deployments, 3,300 pods), through the operator's own Controller,
//! reconcile, gate index and writer, with the
//! Kubernetes API in memory (every request counted; watches replayed from what it stores) and
//! the real broker behind them.
//!
//! Reports: Kubernetes requests per minute at steady state; the requests one rolling restart
//! costs (a Deployment, a StatefulSet, a worker); pod condition patches per pod per rollout (the
//! first False that says why a new pod waits, then one per flip); the time from a consumer's
//! attach to its pod's gate opening with every pod tracked; the operator's RSS. Ends with one
//! `summary k=v` line.
//!
//! `cargo bench --bench fleet` (QUEUEGUARD_BENCH_DEPLOYMENTS, QUEUEGUARD_BENCH_WORKERS,
//! QUEUEGUARD_BENCH_STEADY_SECS, QUEUEGUARD_BENCH_ROLLOUTS, QUEUEGUARD_BENCH_SETTINGS: the
//! policies' `queue.settings`, default Arguments). Consumers attach from a child
//! process (this binary again), so their connections do not count in the operator's memory.
//! The broker here accepts 832 sockets, so consumers share connections: one per ten
//! Deployments, named with every pod of them, and matched to pods by connection name
//! (`consumers.matchBy: ConnectionName`); a rolled-out pod gets a connection of its own.

mod common;

use common::{base64, rss_mib};
use futures::StreamExt;
use http::StatusCode;
use k8s_openapi::api::{
    apps::v1::{Deployment, ReplicaSet, StatefulSet},
    core::v1::Pod,
    policy::v1::PodDisruptionBudget,
};
use kube::api::PartialObjectMeta;
use kube::{
    Client,
    runtime::{Controller, Predicate, WatchStreamExt, predicates, reflector, watcher},
};
use queueguard::workload::Kind;
use queueguard::{
    controller::{self, Context, FINALIZER},
    crd::QueuePolicy,
};
use serde_json::{Value, json};
use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    io::{BufRead, Write},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};
use tokio::sync::mpsc;

const GATE: &str = "queueguard.io/consumer-attached";
const PER_CONNECTION: usize = 10;

fn env(key: &str, default: &str) -> String {
    std::env::var(key).unwrap_or_else(|_| default.to_owned())
}

fn now_ms() -> i64 {
    queueguard::consumers::tracker::now_ms()
}

/// Unix time in microseconds: latencies below a millisecond are told apart.
fn now_us() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_micros() as i64)
}

fn rfc3339(ms: i64) -> String {
    queueguard::consumers::output::rfc3339(ms)
}

/// When a pod's gate condition was last written True (unix µs), and how often it was written at
/// all; kept by pod UID (a StatefulSet's pod comes back under its name).
type Written = (Option<i64>, u32);

/// What the in-memory API tells the watches.
enum Echo {
    Policy(Box<QueuePolicy>),
    Pod(Box<Pod>),
    Budget(Box<PodDisruptionBudget>),
}

/// The Kubernetes API in memory: what the operator reads and writes, each request counted by
/// verb and resource, and each write echoed to the watches.
#[derive(Clone)]
struct FakeApi {
    secret: Value,
    /// Stored as JSON text, as an API server keeps them, so the benchmark's own share of memory
    /// stays small next to the operator's (the watch cache of them is the operator's).
    policies: Arc<Mutex<HashMap<(String, String), String>>>,
    pods: Arc<Mutex<HashMap<(String, String), Pod>>>,
    budgets: Arc<Mutex<HashMap<(String, String), String>>>,
    requests: Arc<Mutex<BTreeMap<String, u64>>>,
    written: Arc<Mutex<HashMap<String, Written>>>,
    echo: mpsc::UnboundedSender<Echo>,
}

impl FakeApi {
    fn count(&self, what: &str) {
        *self.requests.lock().unwrap().entry(what.to_owned()).or_default() += 1;
    }

    fn answer(&self, method: &str, path: &str, body: &[u8]) -> (StatusCode, Value) {
        let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
        let key = |ns: &str, name: &str| (ns.to_owned(), name.to_owned());
        match (method, parts.as_slice()) {
            ("GET", ["api", "v1", "namespaces", _, "secrets", _]) => {
                self.count("get secrets");
                (StatusCode::OK, self.secret.clone())
            }
            ("PATCH", ["apis", "queueguard.io", "v1alpha1", "namespaces", ns, "queuepolicies", name, "status"]) => {
                self.count("patch queuepolicies/status");
                let patch: Value = serde_json::from_slice(body).unwrap();
                let mut policies = self.policies.lock().unwrap();
                let stored = policies.get_mut(&key(ns, name)).expect("known policy");
                let mut policy: QueuePolicy = serde_json::from_str(stored).unwrap();
                policy.status = serde_json::from_value(patch["status"].clone()).ok();
                *stored = serde_json::to_string(&policy).unwrap();
                let answer = serde_json::to_value(&policy).unwrap();
                let _ = self.echo.send(Echo::Policy(Box::new(policy)));
                (StatusCode::OK, answer)
            }
            ("PATCH", ["api", "v1", "namespaces", ns, "pods", name, "status"]) => {
                self.count("patch pods/status");
                let patch: Value = serde_json::from_slice(body).unwrap();
                let mut pods = self.pods.lock().unwrap();
                let Some(pod) = pods.get_mut(&key(ns, name)) else { return not_found(path) };
                let condition: k8s_openapi::api::core::v1::PodCondition =
                    serde_json::from_value(patch["status"]["conditions"][0].clone()).unwrap();
                let conditions = pod.status.get_or_insert_default().conditions.get_or_insert_default();
                conditions.retain(|c| c.type_ != condition.type_);
                let opened = condition.status == "True";
                conditions.push(condition);
                let mut written = self.written.lock().unwrap();
                let entry = written.entry(pod.metadata.uid.clone().unwrap_or_default()).or_default();
                *entry = (if opened { Some(now_us()) } else { entry.0 }, entry.1 + 1);
                let _ = self.echo.send(Echo::Pod(Box::new(pod.clone())));
                (StatusCode::OK, serde_json::to_value(&*pod).unwrap())
            }
            ("PATCH", ["apis", "policy", "v1", "namespaces", ns, "poddisruptionbudgets", name]) => {
                self.count("apply poddisruptionbudgets");
                let budget: PodDisruptionBudget = serde_json::from_slice(body).unwrap();
                self.budgets.lock().unwrap().insert(key(ns, name), String::from_utf8_lossy(body).into_owned());
                let _ = self.echo.send(Echo::Budget(Box::new(budget.clone())));
                (StatusCode::OK, serde_json::to_value(budget).unwrap())
            }
            ("DELETE", ["apis", "policy", "v1", "namespaces", ns, "poddisruptionbudgets", name]) => {
                self.count("delete poddisruptionbudgets");
                self.budgets.lock().unwrap().remove(&key(ns, name));
                (StatusCode::OK, json!({"kind": "Status", "apiVersion": "v1", "status": "Success"}))
            }
            ("PATCH", ["apis", "apps", "v1", "namespaces", _, "deployments", _]) => {
                self.count("patch deployments");
                (StatusCode::OK, json!({}))
            }
            ("POST", ["apis", "events.k8s.io", "v1", "namespaces", _, "events"]) => {
                self.count("create events");
                (StatusCode::CREATED, serde_json::from_slice(body).unwrap())
            }
            ("PATCH", ["apis", "events.k8s.io", "v1", "namespaces", _, "events", _]) => {
                self.count("patch events");
                (StatusCode::OK, serde_json::from_slice(body).unwrap_or(json!({})))
            }
            _ => {
                self.count(&format!("unexpected {method} {path}"));
                not_found(path)
            }
        }
    }

    fn client(&self) -> Client {
        let api = self.clone();
        common::client(move |method, path, body| api.answer(method, path, body))
    }

    /// Every request but reads (the Secret reads that reconciles make on their own schedule).
    fn writes(&self) -> u64 {
        self.requests.lock().unwrap().iter().filter(|(k, _)| !k.starts_with("get ")).map(|(_, v)| v).sum()
    }

    fn snapshot(&self) -> BTreeMap<String, u64> {
        self.requests.lock().unwrap().clone()
    }
}

fn not_found(path: &str) -> (StatusCode, Value) {
    (
        StatusCode::NOT_FOUND,
        json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 404, "reason": "NotFound", "message": path}),
    )
}

fn since(before: &BTreeMap<String, u64>, after: &BTreeMap<String, u64>) -> BTreeMap<String, u64> {
    after.iter().map(|(k, v)| (k.clone(), v - before.get(k).copied().unwrap_or(0))).filter(|(_, v)| *v > 0).collect()
}

fn describe(counts: &BTreeMap<String, u64>) -> String {
    if counts.is_empty() {
        return "none".into();
    }
    counts.iter().map(|(k, v)| format!("{v} {k}")).collect::<Vec<_>>().join(", ")
}

/// One guarded workload of the fleet.
struct Workload {
    kind: Kind,
    namespace: String,
    name: String,
    /// Its queues, one per guarding policy.
    queues: Vec<String>,
    pods: Vec<String>,
    /// Its consumers are still those on its group's shared connection.
    on_group_connection: bool,
}

fn deployment(w: &Workload, generation: i64, observed: i64) -> Deployment {
    serde_json::from_value(json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": w.name, "namespace": w.namespace, "uid": format!("uid-{}", w.name), "generation": generation,
                     "labels": {"tier": "consumers"}},
        "spec": {"replicas": 3, "selector": {"matchLabels": {"app": w.name}},
                 "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
                 "template": {"metadata": {"labels": {"app": w.name}},
                              "spec": {"containers": [{"name": "w", "image": "w"}], "readinessGates": [{"conditionType": GATE}]}}},
        "status": {"observedGeneration": observed, "replicas": 3, "updatedReplicas": 3, "readyReplicas": 3},
    }))
    .unwrap()
}

/// A Deployment's ReplicaSet of revision `hash`, as the metadata watch delivers it.
fn replica_set(w: &Workload, hash: &str) -> PartialObjectMeta<ReplicaSet> {
    serde_json::from_value(json!({
        "apiVersion": "apps/v1", "kind": "ReplicaSet",
        "metadata": {"name": format!("{}-{hash}", w.name), "namespace": w.namespace, "uid": "rs",
                     "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment", "name": w.name,
                                          "uid": format!("uid-{}", w.name), "controller": true}]},
    }))
    .unwrap()
}

/// A StatefulSet of the fleet: RollingUpdate, one pod at a time.
fn stateful_set(w: &Workload, generation: i64, observed: i64) -> StatefulSet {
    serde_json::from_value(json!({
        "apiVersion": "apps/v1", "kind": "StatefulSet",
        "metadata": {"name": w.name, "namespace": w.namespace, "uid": format!("uid-{}", w.name), "generation": generation,
                     "labels": {"tier": "consumers"}},
        "spec": {"replicas": 3, "serviceName": w.name, "selector": {"matchLabels": {"app": w.name}},
                 "template": {"metadata": {"labels": {"app": w.name}},
                              "spec": {"containers": [{"name": "w", "image": "w"}], "readinessGates": [{"conditionType": GATE}]}}},
        "status": {"observedGeneration": observed, "replicas": 3, "updatedReplicas": 3, "readyReplicas": 3},
    }))
    .unwrap()
}

/// A pod of revision `hash`: a StatefulSet's own, or its ReplicaSet's.
fn pod(w: &Workload, name: &str, hash: &str, ip: &str, started_ms: i64) -> Pod {
    let owner = match w.kind {
        Kind::StatefulSet => {
            json!({"apiVersion": "apps/v1", "kind": "StatefulSet", "name": w.name, "uid": "sts", "controller": true})
        }
        _ => {
            json!({"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": format!("{}-{hash}", w.name), "uid": "rs", "controller": true})
        }
    };
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": w.namespace, "uid": format!("uid-{name}-{hash}"),
                     "labels": {"app": w.name, "pod-template-hash": hash},
                     "ownerReferences": [owner]},
        "spec": {"containers": [{"name": "w", "image": "w"}], "readinessGates": [{"conditionType": GATE}]},
        "status": {"phase": "Running", "podIP": ip, "startTime": rfc3339(started_ms),
                   "conditions": [{"type": "ContainersReady", "status": "True", "lastTransitionTime": rfc3339(started_ms)}]},
    }))
    .unwrap()
}

fn policy(namespace: &str, name: &str, queue: &str, w: &Workload, settings: &str) -> QueuePolicy {
    serde_json::from_value(json!({
        "apiVersion": "queueguard.io/v1alpha1", "kind": "QueuePolicy",
        "metadata": {"name": name, "namespace": namespace, "generation": 1, "uid": format!("uid-{namespace}-{name}"),
                     "finalizers": [FINALIZER], "resourceVersion": "1"},
        "spec": {"broker": {"secretRef": {"name": "rabbitmq"}},
                 "queue": {"name": queue, "settings": settings, "expires": "4h"},
                 "consumers": {"workload": {"kind": w.kind.as_str(), "name": w.name}, "minAttachedSeconds": 0, "matchBy": "ConnectionName"}},
    }))
    .unwrap()
}

/// The consumer host: a child process that opens connections and consumers on command, one
/// line each on stdin, answering each with a line (`ok <unix µs after the broker's answer>`).
mod host {
    use super::*;
    use lapin::{Channel, Connection, ConnectionProperties, options::*, types::FieldTable};

    pub async fn run(broker: String) {
        let mut connections: HashMap<String, (Connection, Channel)> = HashMap::new();
        // A dropped lapin Consumer cancels itself: they are kept until told otherwise.
        let mut consumers: HashMap<String, lapin::Consumer> = HashMap::new();
        let stdin = std::io::stdin();
        let mut out = std::io::stdout().lock();
        for line in stdin.lock().lines() {
            let line = line.unwrap();
            let words: Vec<&str> = line.split(' ').collect();
            match words.as_slice() {
                ["open", id, name @ ..] => {
                    let props = ConnectionProperties::default().with_connection_name(name.join(" ").into());
                    let conn = Connection::connect(&broker, props).await.expect("consumer connection");
                    let ch = conn.create_channel().await.unwrap();
                    // A well-behaved consumer: bounded prefetch, manual acks (no findings).
                    ch.basic_qos(10, BasicQosOptions::default()).await.unwrap();
                    connections.insert(id.to_string(), (conn, ch));
                }
                ["consume", id, queue, tag] => {
                    let ch = &connections[*id].1;
                    let options = BasicConsumeOptions::default();
                    let c =
                        ch.basic_consume((*queue).into(), (*tag).into(), options, FieldTable::default()).await.unwrap();
                    consumers.insert(tag.to_string(), c);
                }
                ["cancel", id, tag] => {
                    consumers.remove(*tag);
                    connections[*id].1.basic_cancel((*tag).into(), BasicCancelOptions::default()).await.unwrap();
                }
                ["close", id] => {
                    if let Some((conn, _)) = connections.remove(*id) {
                        let _ = conn.close(200, "bye".into()).await;
                    }
                }
                ["quit"] => break,
                _ => panic!("unknown command {line}"),
            }
            writeln!(out, "ok {}", now_us()).unwrap();
            out.flush().unwrap();
        }
        for (_, (conn, _)) in connections {
            let _ = conn.close(200, "bye".into()).await;
        }
    }
}

/// The parent's end of the consumer host.
struct Host {
    child: std::process::Child,
    stdin: std::process::ChildStdin,
    stdout: std::io::BufReader<std::process::ChildStdout>,
}

impl Host {
    fn start(broker: &str) -> Self {
        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            .env("QUEUEGUARD_FLEET_ROLE", "consumers")
            .env("QUEUEGUARD_FLEET_BROKER", broker)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let stdout = std::io::BufReader::new(child.stdout.take().unwrap());
        Self { child, stdin, stdout }
    }

    /// Sends the commands, then waits for every answer; returns the time of the last.
    fn send(&mut self, commands: &[String]) -> i64 {
        for c in commands {
            writeln!(self.stdin, "{c}").unwrap();
        }
        self.stdin.flush().unwrap();
        let mut last = 0;
        for _ in commands {
            let mut line = String::new();
            self.stdout.read_line(&mut line).unwrap();
            last = line.trim().strip_prefix("ok ").and_then(|t| t.parse().ok()).expect("an answer");
        }
        last
    }

    fn quit(mut self) {
        let _ = writeln!(self.stdin, "quit");
        let _ = self.child.wait();
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

/// Waits until no Kubernetes write came for `quiet` (or `limit` passed); returns how long.
async fn settle(api: &FakeApi, quiet: Duration, limit: Duration) -> Duration {
    let started = Instant::now();
    let (mut last, mut at) = (api.writes(), Instant::now());
    while started.elapsed() < limit {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let now = api.writes();
        if now != last {
            (last, at) = (now, Instant::now());
        } else if at.elapsed() >= quiet {
            break;
        }
    }
    started.elapsed()
}

/// Rolls a workload out as its controller does: a Deployment with maxSurge 1, maxUnavailable 0
/// (one new pod at a time; the old pod goes once the new one's gate is open), a StatefulSet one
/// ordinal at a time from the highest (the old pod goes first, the new one comes back under its
/// name). Each new pod's consumer attaches on a connection of its own. Returns, per new pod, the
/// time from its last consumer's attach to its gate condition's patch True.
async fn roll(
    index: usize,
    w: &mut Workload,
    revision: u32,
    ctx: &Context,
    api: &FakeApi,
    host: &mut Host,
) -> Vec<f64> {
    let hash = format!("r{revision}");
    let apply_pod = |namespace: &str, p: Pod| {
        api.pods.lock().unwrap().insert((namespace.to_owned(), p.metadata.name.clone().unwrap()), p.clone());
        ctx.gate.on(&watcher::Event::Apply(p));
    };
    let remove_pod = |namespace: &str, name: &str| {
        let gone = api.pods.lock().unwrap().remove(&(namespace.to_owned(), name.to_owned()));
        if let Some(mut p) = gone {
            p.metadata.deletion_timestamp =
                Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(k8s_openapi::jiff::Timestamp::now()));
            ctx.gate.on(&watcher::Event::Apply(p.clone()));
            ctx.gate.on(&watcher::Event::Delete(p));
        }
    };
    apply_workload(ctx, w, i64::from(revision), i64::from(revision) - 1);
    let stateful = w.kind == Kind::StatefulSet;
    if !stateful {
        ctx.gate.on(&watcher::Event::Apply(replica_set(w, &hash)));
    }
    let mut latencies = Vec::new();
    let mut old = std::mem::take(&mut w.pods);
    if stateful {
        old.reverse();
    }
    for (i, old_name) in old.iter().enumerate() {
        let name = if stateful { old_name.clone() } else { format!("{}-{hash}-{i}", w.name) };
        if stateful {
            remove_pod(&w.namespace, old_name);
        }
        let started = now_ms();
        let ip = format!("10.{}.{}.{}", 100 + revision, index / 250, (index % 250) * 3 + i);
        let new = pod(w, &name, &hash, &ip, started);
        let uid = new.metadata.uid.clone().unwrap();
        apply_pod(&w.namespace, new);
        let id = format!("c-{name}");
        let mut commands = vec![format!("open {id} {}/{name}", w.namespace)];
        commands.extend(w.queues.iter().enumerate().map(|(q, queue)| format!("consume {id} {queue} {name}-{q}")));
        let attached = host.send(&commands);
        let deadline = Instant::now() + Duration::from_secs(10);
        let written = loop {
            if let Some((Some(at), _)) = api.written.lock().unwrap().get(&uid).copied() {
                break at;
            }
            assert!(Instant::now() < deadline, "the gate of {name} never opened");
            tokio::time::sleep(Duration::from_millis(1)).await;
        };
        latencies.push((written - attached) as f64 / 1000.0);
        // A Deployment's old pod goes once the new one is available: terminating, then deleted.
        if !stateful {
            remove_pod(&w.namespace, old_name);
        }
        w.pods.push(name);
    }
    // The old pods' consumers left with them (they share their group's connection).
    let group = format!("g{}", index / PER_CONNECTION);
    let cancels: Vec<String> = (0..w.queues.len()).map(|q| format!("cancel {group} {}-{q}", w.name)).collect();
    if std::mem::take(&mut w.on_group_connection) {
        host.send(&cancels);
    }
    apply_workload(ctx, w, i64::from(revision), i64::from(revision));
    latencies
}

/// The workload as its watch delivers it.
fn apply_workload(ctx: &Context, w: &Workload, generation: i64, observed: i64) {
    match w.kind {
        Kind::StatefulSet => ctx.gate.on(&watcher::Event::Apply(stateful_set(w, generation, observed))),
        _ => ctx.gate.on(&watcher::Event::Apply(deployment(w, generation, observed))),
    }
}

#[tokio::main]
async fn main() {
    queueguard::tls::install_crypto_provider();
    if std::env::var("QUEUEGUARD_FLEET_ROLE").as_deref() == Ok("consumers") {
        return host::run(env("QUEUEGUARD_FLEET_BROKER", "")).await;
    }
    let singles: usize = env("QUEUEGUARD_BENCH_DEPLOYMENTS", "1000").parse().unwrap();
    let workers: usize = env("QUEUEGUARD_BENCH_WORKERS", "100").parse().unwrap();
    let steady_secs: u64 = env("QUEUEGUARD_BENCH_STEADY_SECS", "60").parse().unwrap();
    // Policy: every queue's settings in a broker policy, whose list each keepAlive renewal
    // (5 minutes) reads; a steady state longer than that shows what the renewals cost.
    let settings = env("QUEUEGUARD_BENCH_SETTINGS", "Arguments");
    let rollouts: usize = env("QUEUEGUARD_BENCH_ROLLOUTS", "20").parse().unwrap();
    let broker = env("QUEUEGUARD_BENCH_BROKER", "amqp://guest:guest@127.0.0.1:5672/%2F");
    let management = env("QUEUEGUARD_BENCH_MANAGEMENT", "http://127.0.0.1:15672");
    let run = format!("qgfleet.{}", std::process::id());

    // The fleet: every tenth workload starts a namespace (with its own broker Secret); every third
    // is a StatefulSet.
    let mut workloads: Vec<Workload> = (0..singles + workers)
        .map(|i| {
            let name = format!("d{i}");
            let queues = if i < singles {
                vec![format!("{run}.q{i}")]
            } else {
                (0..3).map(|q| format!("{run}.q{i}.{q}")).collect()
            };
            let kind = if i % 3 == 2 { Kind::StatefulSet } else { Kind::Deployment };
            Workload {
                kind,
                namespace: format!("fleet-{}", i / PER_CONNECTION),
                pods: (0..3)
                    .map(|p| if kind == Kind::StatefulSet { format!("{name}-{p}") } else { format!("{name}-r1-{p}") })
                    .collect(),
                name,
                queues,
                on_group_connection: true,
            }
        })
        .collect();
    let (echo_tx, mut echo_rx) = mpsc::unbounded_channel();
    let api = FakeApi {
        secret: json!({
            "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "rabbitmq"},
            "data": {"uri": base64(&broker), "managementUri": base64(&management.replace("http://", "http://guest:guest@"))},
        }),
        policies: Arc::default(),
        pods: Arc::default(),
        budgets: Arc::default(),
        requests: Arc::default(),
        written: Arc::default(),
        echo: echo_tx,
    };
    let mut policies = Vec::new();
    let mut deployments = Vec::new();
    let mut stateful_sets = Vec::new();
    let mut pods = Vec::new();
    // Running for a minute: the operator is new to them (a first install), not they to it.
    let long_ago = now_ms() - 60_000;
    for (i, w) in workloads.iter().enumerate() {
        for (q, queue) in w.queues.iter().enumerate() {
            let name = if w.queues.len() == 1 { format!("p{i}") } else { format!("p{i}-{q}") };
            let p = policy(&w.namespace, &name, queue, w, &settings);
            api.policies.lock().unwrap().insert((w.namespace.clone(), name), serde_json::to_string(&p).unwrap());
            policies.push(p);
        }
        match w.kind {
            Kind::StatefulSet => stateful_sets.push(stateful_set(w, 1, 1)),
            _ => deployments.push(deployment(w, 1, 1)),
        }
        for (j, name) in w.pods.iter().enumerate() {
            let p = pod(w, name, "r1", &format!("10.{}.{}.{j}", i / 250, i % 250), long_ago);
            api.pods.lock().unwrap().insert((w.namespace.clone(), name.clone()), p.clone());
            pods.push(p);
        }
    }
    let (n_policies, n_pods) = (policies.len(), pods.len());
    println!(
        "fleet: {} workloads of 3 pods ({} Deployments, {} StatefulSets; {singles} guarded by one QueuePolicy, {workers} workers by three): {n_policies} policies, {n_pods} pods",
        workloads.len(),
        deployments.len(),
        stateful_sets.len()
    );

    // The operator: Controller, reconcile, gate index and pod writer against the in-memory API.
    let baseline = rss_mib("VmRSS:");
    let ctx = Arc::new(Context::new(api.client(), "queueguard-fleet"));
    let (policy_tx, policy_rx) = mpsc::unbounded_channel::<watcher::Event<QueuePolicy>>();
    let _ = policy_tx.send(watcher::Event::Init);
    for p in &policies {
        let _ = policy_tx.send(watcher::Event::InitApply(p.clone()));
    }
    let _ = policy_tx.send(watcher::Event::InitDone);
    let gate = ctx.gate.clone();
    gate.on(&watcher::Event::<Deployment>::Init);
    for d in deployments {
        gate.on(&watcher::Event::InitApply(d));
    }
    gate.on(&watcher::Event::<Deployment>::InitDone);
    gate.on(&watcher::Event::<StatefulSet>::Init);
    for s in stateful_sets {
        gate.on(&watcher::Event::InitApply(s));
    }
    gate.on(&watcher::Event::<StatefulSet>::InitDone);
    gate.on(&watcher::Event::<PartialObjectMeta<ReplicaSet>>::Init);
    for w in workloads.iter().filter(|w| w.kind == Kind::Deployment) {
        gate.on(&watcher::Event::InitApply(replica_set(w, "r1")));
    }
    gate.on(&watcher::Event::<PartialObjectMeta<ReplicaSet>>::InitDone);
    gate.kind_unavailable(queueguard::workload::Kind::Rollout);
    gate.on(&watcher::Event::<PodDisruptionBudget>::Init);
    gate.on(&watcher::Event::<PodDisruptionBudget>::InitDone);
    gate.on(&watcher::Event::<Pod>::Init);
    for p in pods {
        gate.on(&watcher::Event::InitApply(p));
    }
    // The watches: what the API stores comes back, as a real watch would deliver it.
    let (g, policy_echo) = (ctx.gate.clone(), policy_tx.clone());
    tokio::spawn(async move {
        while let Some(echo) = echo_rx.recv().await {
            match echo {
                Echo::Policy(p) => {
                    let _ = policy_echo.send(watcher::Event::Apply(*p));
                }
                Echo::Pod(p) => g.on(&watcher::Event::Apply(*p)),
                Echo::Budget(b) => g.on(&watcher::Event::Apply(*b)),
            }
        }
    });
    let (store, writer) = reflector::store();
    let g = ctx.gate.clone();
    let watch = futures::stream::unfold(policy_rx, |mut rx| async { rx.recv().await.map(|e| (Ok(e), rx)) })
        .inspect(move |e: &Result<watcher::Event<QueuePolicy>, watcher::Error>| {
            if let Ok(e) = e {
                g.on(e);
            }
        })
        .reflect(writer)
        .applied_objects()
        .predicate_filter(predicates::generation.combine(predicates::finalizers), Default::default());
    let wakes = ctx.take_wake_receiver().unwrap();
    let wakes = futures::stream::unfold(wakes, |mut rx| async { rx.recv().await.map(|r| (r, rx)) });
    let started = Instant::now();
    gate.on(&watcher::Event::<Pod>::InitDone);
    let controller = Controller::for_stream(watch, store)
        .reconcile_on(wakes)
        .with_config(kube::runtime::controller::Config::default().concurrency(controller::CONCURRENCY))
        .run(controller::reconcile, controller::error_policy, ctx.clone())
        .for_each(|_| async {});
    let operator = tokio::spawn(controller);

    // Cold start: every policy reconciled, every pod's gate open.
    let deadline = Instant::now() + Duration::from_secs(600);
    // Every queue declared (the cold start's reconciles); then the consumers attach, from the
    // child: one connection per ten Deployments.
    while api.policies.lock().unwrap().values().filter(|p| p.contains("\"status\"")).count() < n_policies
        && Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let declared = started.elapsed();
    let mut host = Host::start(&broker);
    let attaching = Instant::now();
    for (g, group) in workloads.chunks(PER_CONNECTION).enumerate() {
        let names: Vec<String> =
            group.iter().flat_map(|w| w.pods.iter().map(|p| format!("{}/{p}", w.namespace))).collect();
        let mut commands = vec![format!("open g{g} {}", names.join(" "))];
        for w in group {
            commands
                .extend(w.queues.iter().enumerate().map(|(q, queue)| format!("consume g{g} {queue} {}-{q}", w.name)));
        }
        host.send(&commands);
    }
    let attached = attaching.elapsed();
    println!(
        "  every policy reconciled once after {:.1}s; {} consumers on {} connections attached from the child process in {:.1}s",
        declared.as_secs_f64(),
        workloads.iter().map(|w| w.queues.len()).sum::<usize>(),
        workloads.len().div_ceil(PER_CONNECTION),
        attached.as_secs_f64()
    );
    let open = || api.written.lock().unwrap().values().filter(|(at, _)| at.is_some()).count();
    while open() < n_pods && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let opened = attaching.elapsed();
    let open = open();
    // Quiet for longer than the findings' interval, after the first keepAlive renewal (5
    // minutes after each queue's declaration) has brought the queues' consumer counts, which
    // the management API lists after its statistics interval, into status.
    let settled = settle(&api, controller::FINDINGS_EVERY + Duration::from_secs(5), Duration::from_secs(600)).await;
    let cold = api.snapshot();
    let ready = api
        .policies
        .lock()
        .unwrap()
        .values()
        .filter(|text| {
            let p: QueuePolicy = serde_json::from_str(text).unwrap();
            p.status.is_some_and(|s| s.conditions.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
        })
        .count();
    println!(
        "  cold start: {open}/{n_pods} gates open {:.1}s after the consumers began attaching, {ready}/{n_policies} policies Ready, quiet after {:.1}s more; requests: {}",
        opened.as_secs_f64(),
        settled.as_secs_f64(),
        describe(&cold)
    );

    // Steady state: nothing changes; reconciles keep coming every 20 s (the findings' looks).
    let statuses = || -> HashMap<(String, String), Value> {
        let stored = api.policies.lock().unwrap();
        stored
            .iter()
            .map(|(k, text)| (k.clone(), serde_json::from_str::<Value>(text).unwrap()["status"].clone()))
            .collect()
    };
    let statuses_before = statuses();
    let before = api.snapshot();
    let mgmt = || ctx.shared.brokers.management_requests() + ctx.trackers.management_requests();
    let mgmt_before = mgmt();
    tokio::time::sleep(Duration::from_secs(steady_secs)).await;
    let steady = since(&before, &api.snapshot());
    let per_minute = steady.values().sum::<u64>() as f64 * 60.0 / steady_secs as f64;
    let gate_steady: u64 = steady
        .iter()
        .filter(|(k, _)| k.contains("pods") || k.contains("budgets") || k.contains("deployments"))
        .map(|(_, v)| v)
        .sum();
    let mgmt_per_minute = (mgmt() - mgmt_before) as f64 * 60.0 / steady_secs as f64;
    // Which parts of the statuses the steady state's patches changed, and in how many policies.
    let mut changed: BTreeMap<String, usize> = BTreeMap::new();
    let mut example: BTreeMap<String, String> = BTreeMap::new();
    for (key, after) in statuses() {
        let was = statuses_before.get(&key).cloned().unwrap_or(Value::Null);
        let fields: BTreeSet<&String> =
            after.as_object().into_iter().chain(was.as_object()).flat_map(|o| o.keys()).collect();
        for field in fields {
            if after.get(field) != was.get(field) {
                *changed.entry(field.clone()).or_default() += 1;
                example.entry(field.clone()).or_insert_with(|| format!("{} -> {}", was[field], after[field]));
            }
        }
    }
    println!("  status fields the steady state changed (policies): {changed:?}, for example {example:?}");
    println!(
        "  steady state over {steady_secs}s: {per_minute:.0} Kubernetes requests/min ({}), of which the gate's (pods, budgets, Deployments): {gate_steady}; management API {mgmt_per_minute:.0} requests/min",
        describe(&steady)
    );

    // One rolling restart of one Deployment and of one StatefulSet, each guarded by one policy,
    // then of one worker guarded by three: every request it costs, and the pod condition patches
    // per new pod.
    let mut costs = Vec::new();
    for index in [0, 2, singles.min(workloads.len() - 1)] {
        let before = api.snapshot();
        let patches_before: u32 = api.written.lock().unwrap().values().map(|(_, n)| n).sum();
        let w = &mut workloads[index];
        roll(index, w, 2, &ctx, &api, &mut host).await;
        settle(&api, Duration::from_secs(2), Duration::from_secs(60)).await;
        let cost = since(&before, &api.snapshot());
        let patches: u32 = api.written.lock().unwrap().values().map(|(_, n)| n).sum::<u32>() - patches_before;
        println!(
            "  one rolling restart of {} {} ({} polic{}): {} requests ({}); {} pod condition patches for 3 new pods",
            w.kind.as_str(),
            w.name,
            w.queues.len(),
            if w.queues.len() == 1 { "y" } else { "ies" },
            cost.values().sum::<u64>(),
            describe(&cost),
            patches
        );
        costs.push((cost.values().sum::<u64>(), f64::from(patches) / 3.0));
    }

    // Attach-to-patch latency with every pod tracked: more rollouts, one after another.
    let mut latencies = Vec::new();
    for k in 0..rollouts {
        let index = 1 + k * (workloads.len() - 2) / rollouts.max(1);
        latencies.extend(roll(index, &mut workloads[index], 2, &ctx, &api, &mut host).await);
    }
    latencies.sort_by(f64::total_cmp);
    let (p50, p99, max) = (percentile(&latencies, 0.5), percentile(&latencies, 0.99), percentile(&latencies, 1.0));
    let tracked = ctx.gate.read(|i| i.pod_count());
    println!(
        "  consumer attach to its pod's patch ({} new pods, {tracked} pods tracked): p50 {p50:.1} ms, p99 {p99:.1} ms, max {max:.1} ms",
        latencies.len()
    );
    let rss = rss_mib("VmHWM:");
    let now_rss = rss_mib("VmRSS:");
    println!(
        "  RSS: peak {rss:.1} MiB, now {now_rss:.1} MiB; the operator's part above the {baseline:.1} MiB the benchmark held before: {:.1} MiB (peak), {:.1} MiB (now)",
        rss - baseline,
        now_rss - baseline
    );
    let unexpected: u64 = api.snapshot().iter().filter(|(k, _)| k.starts_with("unexpected")).map(|(_, v)| v).sum();

    // The operator stops before the clean-up, or it would declare the queues again.
    operator.abort();
    host.quit();
    let conn = lapin::Connection::connect(&broker, lapin::ConnectionProperties::default()).await.unwrap();
    let ch = conn.create_channel().await.unwrap();
    for w in &workloads {
        for q in &w.queues {
            for name in [q.clone(), format!("{q}.dlq")] {
                let _ = ch.queue_delete(name.as_str().into(), Default::default()).await;
            }
            let _ = ch.exchange_delete(format!("{q}.dlx").as_str().into(), Default::default()).await;
        }
    }
    println!(
        "summary policies={n_policies} settings={settings} workloads={} pods={n_pods} cold_open_s={:.1} ready={ready} steady_kube_per_min={per_minute:.0} steady_gate_requests={gate_steady} steady_mgmt_per_min={mgmt_per_minute:.0} rollout_requests_single={} rollout_requests_statefulset={} rollout_requests_worker={} patches_per_pod_single={:.2} patches_per_pod_statefulset={:.2} patches_per_pod_worker={:.2} attach_to_patch_p50_ms={p50:.1} attach_to_patch_p99_ms={p99:.1} attach_to_patch_max_ms={max:.1} attaches={} tracked_pods={tracked} operator_rss_mib={:.1} peak_rss_mib={rss:.1} unexpected_requests={unexpected}",
        workloads.len(),
        opened.as_secs_f64(),
        costs[0].0,
        costs[1].0,
        costs.get(2).map_or(0, |c| c.0),
        costs[0].1,
        costs[1].1,
        costs.get(2).map_or(0.0, |c| c.1),
        latencies.len(),
        rss - baseline,
    );
}
