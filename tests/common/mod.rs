//! Shared helpers for the tests that talk to the real broker (127.0.0.1:5672 unless
//! QUEUEGUARD_TEST_BROKER says otherwise). Every test uses its own unique names.
#![allow(dead_code)] // each test binary uses a different subset

pub mod api;
pub mod gate;
pub mod schema;
pub mod tls;
pub mod traffic;

use lapin::{
    BasicProperties, Channel, Connection, ConnectionProperties,
    options::{BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions},
    types::FieldTable,
};
use queueguard::{
    broker::{Broker, BrokerCredentials, BrokerPool},
    consumers::{Change, QueueKey},
    crd::QueuePolicy,
    pass,
    plan::{self, Limits, QueuePlan},
};
use serde_json::Value;
use std::{
    sync::{
        Arc,
        atomic::{AtomicU32, Ordering},
    },
    time::{Duration, Instant},
};

pub fn broker_uri() -> String {
    std::env::var("QUEUEGUARD_TEST_BROKER").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2F".into())
}

/// `rabbitmqctl` of the broker under test: the machine's own, or the command
/// QUEUEGUARD_TEST_RABBITMQCTL names (`scripts/rabbitmq4.sh ctl` for RabbitMQ 4).
pub fn rabbitmqctl(args: &[&str]) -> std::process::Output {
    let command = std::env::var("QUEUEGUARD_TEST_RABBITMQCTL").unwrap_or_else(|_| "rabbitmqctl".into());
    let mut words = command.split_whitespace();
    std::process::Command::new(words.next().expect("a command")).args(words).args(args).output().unwrap()
}

pub fn management_base() -> String {
    std::env::var("QUEUEGUARD_TEST_MANAGEMENT").unwrap_or_else(|_| "http://127.0.0.1:15672".into())
}

/// Where the test broker's rabbitmq_prometheus listens, when not beside its management API on
/// port 15692 (QUEUEGUARD_TEST_PROMETHEUS: RabbitMQ 4.0 here, whose host's 15692 is 3.10's).
pub fn prometheus_base() -> Option<String> {
    std::env::var("QUEUEGUARD_TEST_PROMETHEUS").ok()
}

/// A name no other test (or earlier run) uses.
pub fn unique(prefix: &str) -> String {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos();
    format!("qgt.{prefix}.{}.{nanos:x}.{}", std::process::id(), COUNTER.fetch_add(1, Ordering::Relaxed))
}

/// A QueuePolicy `test/<name>` whose spec.queue is `queue` (YAML flow mapping).
pub fn policy(name: &str, queue: &str) -> QueuePolicy {
    policy_doc(name, &format!("queue: {queue}"))
}

/// A QueuePolicy `test/<name>` with `rest` as the spec after `broker` (YAML block).
pub fn policy_doc(name: &str, rest: &str) -> QueuePolicy {
    let doc = format!(
        "apiVersion: queueguard.io/v1alpha1\nkind: QueuePolicy\nmetadata: {{name: {name:?}, namespace: test, generation: 1}}\nspec:\n  broker: {{secretRef: {{name: rabbitmq}}}}\n  {rest}\n"
    );
    serde_yaml_ng::from_str(&doc).expect("test policy parses")
}

pub fn plan_of(policy: &QueuePolicy) -> QueuePlan {
    plan::plan(policy, Limits::default()).expect("valid test policy")
}

/// Plans with the 1-minute expiry floor lifted, to watch a queue expire within a test.
pub fn plan_short(policy: &QueuePolicy) -> QueuePlan {
    plan::plan(policy, Limits { min_expires: Duration::from_millis(100) }).expect("valid test policy")
}

pub fn credentials() -> BrokerCredentials {
    BrokerCredentials {
        uri: broker_uri(),
        management_uri: Some(management_base()),
        ca_cert: None,
        addresses: None,
        prometheus_uri: prometheus_base(),
    }
}

pub fn broker(pool: &BrokerPool, plan: &QueuePlan) -> Arc<Broker> {
    pass::broker_for_plan(pool, plan, &credentials()).expect("test broker")
}

/// An application's own connection, as a consumer or publisher would have.
pub async fn app() -> (Connection, Channel) {
    let conn =
        Connection::connect(&broker_uri(), ConnectionProperties::default().with_connection_name("qgt-app".into()))
            .await
            .expect("application connection");
    let ch = conn.create_channel().await.expect("channel");
    (conn, ch)
}

/// Publishes to a queue through the default exchange with publisher confirms.
pub async fn publish(queue: &str, bodies: impl IntoIterator<Item = String>) {
    let (_conn, ch) = app().await;
    ch.confirm_select(ConfirmSelectOptions::default()).await.unwrap();
    for body in bodies {
        ch.basic_publish(
            "".into(),
            queue.into(),
            BasicPublishOptions::default(),
            body.as_bytes(),
            BasicProperties::default().with_delivery_mode(2),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    }
}

/// Ready messages and consumers, by passive declare; None when the queue does not exist.
pub async fn counts(queue: &str) -> Option<(u32, u32)> {
    let (_conn, ch) = app().await;
    let passive = QueueDeclareOptions { passive: true, ..Default::default() };
    ch.queue_declare(queue.into(), passive, FieldTable::default())
        .await
        .ok()
        .map(|q| (q.message_count(), q.consumer_count()))
}

/// Does the queue exist? Asked through the management API, which does not renew x-expires.
pub async fn exists(queue: &str) -> bool {
    mgmt_get(&format!("queues/%2F/{}", enc(queue))).await.is_some()
}

pub async fn delete_queues(names: &[&str]) {
    let (_conn, ch) = app().await;
    for name in names {
        let _ = ch.queue_delete((*name).into(), QueueDeleteOptions::default()).await;
    }
}

pub fn enc(s: &str) -> String {
    percent_encoding::utf8_percent_encode(s, percent_encoding::NON_ALPHANUMERIC).to_string()
}

fn http() -> reqwest::Client {
    queueguard::tls::install_crypto_provider();
    reqwest::Client::new()
}

/// GET /api/<path> on the management API; None on 404.
pub async fn mgmt_get(path: &str) -> Option<Value> {
    let r = http()
        .get(format!("{}/api/{path}", management_base()))
        .basic_auth("guest", Some("guest"))
        .send()
        .await
        .unwrap();
    if r.status() == 404 {
        return None;
    }
    assert!(r.status().is_success(), "GET {path}: {}", r.status());
    Some(r.json().await.unwrap())
}

/// The HTTP status of GET /api/<path>.
pub async fn mgmt_status(path: &str) -> u16 {
    let r = http().get(format!("{}/api/{path}", management_base())).basic_auth("guest", Some("guest")).send().await;
    r.unwrap().status().as_u16()
}

pub async fn mgmt_put(path: &str, body: Value) {
    let r = http()
        .put(format!("{}/api/{path}", management_base()))
        .basic_auth("guest", Some("guest"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "PUT {path}: {}", r.status());
}

pub async fn mgmt_delete(path: &str) {
    let _ = http().delete(format!("{}/api/{path}", management_base())).basic_auth("guest", Some("guest")).send().await;
}

/// Polls `check` every 100 ms until it is true or `timeout` passes; returns whether it became true.
pub async fn eventually<F, Fut>(timeout: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if check().await {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Removes everything a plan declared, messages included (test clean-up only).
pub async fn remove_all(plan: &QueuePlan) {
    delete_queues(&[&plan.queue, &plan.dead_letter_queue]).await;
    let (_conn, ch) = app().await;
    let _ = ch.exchange_delete(plan.settings.dead_letter_exchange.as_str().into(), Default::default()).await;
    mgmt_delete(&format!("policies/%2F/{}", enc(&plan.policy_name))).await;
}

/// A TCP proxy in front of the broker that a test can cut (live connections dropped, new ones
/// closed at once, as a broker that went away) and restore, without disturbing other tests.
pub struct Proxy {
    pub port: u16,
    up: Arc<std::sync::atomic::AtomicBool>,
    kill: tokio::sync::broadcast::Sender<()>,
}

impl Proxy {
    pub async fn start(target: &str) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let up = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let (kill, _) = tokio::sync::broadcast::channel(4);
        let (target, up2, kill2) = (target.to_owned(), up.clone(), kill.clone());
        tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                if !up2.load(Ordering::SeqCst) {
                    continue; // dropped: the client sees the connection closed
                }
                let target = target.clone();
                let mut killed = kill2.subscribe();
                tokio::spawn(async move {
                    let Ok(mut outbound) = tokio::net::TcpStream::connect(target).await else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                        _ = killed.recv() => {}
                    }
                });
            }
        });
        Self { port, up, kill }
    }

    pub fn cut(&self) {
        self.up.store(false, Ordering::SeqCst);
        let _ = self.kill.send(());
    }

    pub fn restore(&self) {
        self.up.store(true, Ordering::SeqCst);
    }

    /// The test broker's URI with this proxy as host and port.
    pub fn uri(&self) -> String {
        let mut url = url::Url::parse(&broker_uri()).unwrap();
        url.set_host(Some("127.0.0.1")).unwrap();
        url.set_port(Some(self.port)).unwrap();
        url.to_string()
    }
}

/// host:port of the test broker's AMQP listener.
pub fn broker_addr() -> String {
    let url = url::Url::parse(&broker_uri()).unwrap();
    format!("{}:{}", url.host_str().unwrap(), url.port().unwrap_or(5672))
}

/// Runs the built `queueguard` binary with `args` and `env`, feeding it `stdin`.
pub fn run_binary(args: &[&str], env: &[(&str, String)], stdin: Option<&str>) -> std::process::Output {
    use std::{io::Write, process::Stdio};
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_queueguard"))
        .args(args)
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(stdin.unwrap_or("").as_bytes()).unwrap();
    child.wait_with_output().unwrap()
}

/// The next change the tracker reports about `queue`, within `within`.
pub async fn next_change_on(
    rx: &mut tokio::sync::broadcast::Receiver<Change>,
    queue: &QueueKey,
    within: Duration,
) -> Option<Change> {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let change = tokio::time::timeout_at(deadline, rx.recv()).await.ok()?.ok()?;
        if change.queue() == Some(queue) {
            return Some(change);
        }
    }
}
