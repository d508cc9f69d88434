//! Against a real 3-node RabbitMQ cluster (`scripts/rabbitmq-cluster.sh`): one subscription sees
//! every node, a crashed node's consumers are gone at once, the operator fails over to the next
//! node, and a rolling restart of the broker during consumer rollouts loses nothing.
//!
//! These tests kill and restart nodes, so `scripts/test.sh` runs them alone and one at a time,
//! with QUEUEGUARD_CLUSTER_ADDRESSES and QUEUEGUARD_CLUSTER_MANAGEMENT naming the cluster.
//! Without them every test here says it is skipped and passes.

mod common;

use common::{api::mock_client, gate::*, *};
use k8s_openapi::api::core::v1::Pod;
use lapin::{
    Connection, ConnectionProperties,
    options::{BasicConsumeOptions, QueueDeclareOptions},
    types::{AMQPValue, FieldTable},
};
use queueguard::{
    broker::{BrokerCredentials, BrokerPool, uri::BrokerUri},
    consumers::{
        Change, ConsumerTracker, QueueKey, TrackerPool, Tracking,
        tracker::{Interest, STATS_LAG},
    },
    controller::{Context, gate_io::QueueWatch},
    converge::{self, Mode},
    gate::index::ObjectKey,
    pass,
    simulation::{self, Scenario},
};
use serde_json::json;
use std::{
    collections::BTreeSet,
    sync::Arc,
    time::{Duration, Instant},
};

const NODES: [&str; 3] = ["qa", "qb", "qc"];

struct Cluster {
    addresses: String,
    management: String,
}

impl Cluster {
    /// The cluster named by the environment; None (after saying so) when there is none.
    fn from_env(test: &str) -> Option<Self> {
        match (std::env::var("QUEUEGUARD_CLUSTER_ADDRESSES"), std::env::var("QUEUEGUARD_CLUSTER_MANAGEMENT")) {
            (Ok(addresses), Ok(management)) => Some(Self { addresses, management }),
            _ => {
                eprintln!(
                    "SKIPPED {test}: no RabbitMQ cluster (scripts/test.sh starts one with scripts/rabbitmq-cluster.sh and sets QUEUEGUARD_CLUSTER_ADDRESSES)"
                );
                None
            }
        }
    }

    /// The AMQP address of node `i` (qa = 0).
    fn address(&self, i: usize) -> &str {
        self.addresses.split(',').nth(i).expect("three nodes")
    }

    fn amqp(&self, i: usize) -> String {
        format!("amqp://guest:guest@{}/%2F", self.address(i))
    }

    /// Credentials as a Secret with `addresses` gives them: qa first.
    fn credentials(&self) -> BrokerCredentials {
        BrokerCredentials {
            uri: self.amqp(0),
            management_uri: Some(self.management.clone()),
            ca_cert: None,
            addresses: Some(self.addresses.clone()),
            prometheus_uri: None,
        }
    }

    fn uri(&self) -> BrokerUri {
        BrokerUri::from_credentials(&self.credentials()).unwrap()
    }

    fn tracker(&self, pool: &TrackerPool) -> Arc<ConsumerTracker> {
        pool.tracker(&self.uri(), None).unwrap()
    }

    /// A tracker whose events flow, and a new quorum queue it keeps track of (while the
    /// returned Interest lives).
    async fn tracked_queue(&self, prefix: &str) -> (TrackerPool, Arc<ConsumerTracker>, String, Interest) {
        let pool = TrackerPool::new(&unique("cluster"));
        let t = self.tracker(&pool);
        assert!(tracking_events(&t, Duration::from_secs(15)).await, "{}", t.tracking("/"));
        let queue = unique(prefix);
        self.quorum_queue(&queue).await;
        let interest = t.watch(QueueKey::new("/", &queue));
        (pool, t, queue, interest)
    }

    /// A connection to node `i` only, as an application pinned to it.
    async fn app(&self, i: usize, name: &str) -> (Connection, lapin::Channel) {
        let props = ConnectionProperties::default().with_connection_name(name.into());
        let conn = Connection::connect(&self.amqp(i), props).await.unwrap();
        let ch = conn.create_channel().await.unwrap();
        (conn, ch)
    }

    /// A quorum queue with a member on every node.
    async fn quorum_queue(&self, name: &str) {
        let (_c, ch) = self.app(0, "qgt-declare").await;
        let mut args = FieldTable::default();
        args.insert("x-queue-type".into(), AMQPValue::LongString("quorum".into()));
        let durable = QueueDeclareOptions { durable: true, ..Default::default() };
        ch.queue_declare(name.into(), durable, args).await.unwrap();
    }

    async fn delete_queue(&self, name: &str) {
        if let Some((_c, ch)) = self.any_app().await {
            let _ = ch.queue_delete(name.into(), Default::default()).await;
        }
    }

    async fn any_app(&self) -> Option<(Connection, lapin::Channel)> {
        for i in 0..NODES.len() {
            if let Ok(conn) = Connection::connect(&self.amqp(i), ConnectionProperties::default()).await {
                let ch = conn.create_channel().await.ok()?;
                return Some((conn, ch));
            }
        }
        None
    }
}

fn cluster_script(args: &[&str]) {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/rabbitmq-cluster.sh");
    let out = std::process::Command::new("bash").arg(script).args(args).output().unwrap();
    assert!(out.status.success(), "rabbitmq-cluster.sh {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// Starts a node again when dropped, so a failing test leaves the cluster whole for the next.
struct Revive(&'static str);

impl Drop for Revive {
    fn drop(&mut self) {
        cluster_script(&["start-node", self.0]);
    }
}

fn kill(node: &'static str) -> Revive {
    cluster_script(&["kill-node", node]);
    Revive(node)
}

async fn tracking_events(t: &ConsumerTracker, within: Duration) -> bool {
    t.wait_synced("/", within).await && eventually(within, || async { t.tracking("/") == Tracking::Events }).await
}

fn node_name(node: &str) -> String {
    format!("{node}@localhost")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumers_attached_on_every_node_are_seen_through_one_subscription() {
    let Some(cluster) = Cluster::from_env("consumers_attached_on_every_node_are_seen_through_one_subscription") else {
        return;
    };
    let (_pool, t, queue, _interest) = cluster.tracked_queue("every-node").await;
    let key = QueueKey::new("/", &queue);
    let mut rx = t.subscribe();

    let mut apps = Vec::new();
    let mut seen = BTreeSet::new();
    for (i, node) in NODES.iter().enumerate() {
        let (conn, ch) = cluster.app(i, &format!("pod-on-{node}")).await;
        let started = Instant::now();
        // Kept: lapin cancels a consumer when it is dropped.
        let kept = ch
            .basic_consume(queue.as_str().into(), (*node).into(), BasicConsumeOptions::default(), FieldTable::default())
            .await
            .unwrap();
        let Some(Change::Attached { consumer }) = next_change_on(&mut rx, &key, Duration::from_secs(2)).await else {
            panic!("no attach event within 2 s for the consumer on {node}")
        };
        eprintln!("consumer on {node}: attach event after {:?}", started.elapsed());
        assert_eq!(consumer.connection_name, Some(format!("pod-on-{node}")));
        assert_eq!(consumer.node, Some(node_name(node)), "the channel's node, from its pid");
        seen.insert(consumer.node.unwrap());
        apps.push((conn, ch, kept));
    }
    assert_eq!(seen.len(), 3);
    assert_eq!(t.consumers_on(&key).len(), 3);
    drop(apps);
    cluster.delete_queue(&queue).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_node_takes_its_consumers_with_it_within_two_seconds() {
    let Some(cluster) = Cluster::from_env("a_killed_node_takes_its_consumers_with_it_within_two_seconds") else {
        return;
    };
    let (_pool, t, queue, _interest) = cluster.tracked_queue("node-crash").await;
    let key = QueueKey::new("/", &queue);
    let mut rx = t.subscribe();
    let (_doomed, ch_c) = cluster.app(2, "pod-on-qc").await;
    let _on_qc = ch_c
        .basic_consume(queue.as_str().into(), "on-qc".into(), BasicConsumeOptions::default(), FieldTable::default())
        .await
        .unwrap();
    let (_kept, ch_b) = cluster.app(1, "pod-on-qb").await;
    let _on_qb = ch_b
        .basic_consume(queue.as_str().into(), "on-qb".into(), BasicConsumeOptions::default(), FieldTable::default())
        .await
        .unwrap();
    for _ in 0..2 {
        assert!(matches!(next_change_on(&mut rx, &key, Duration::from_secs(2)).await, Some(Change::Attached { .. })));
    }

    let killed = Instant::now();
    let revive = kill("qc");
    // A crashed node sends no consumer.deleted: only the node check can say the consumer left.
    let Some(Change::Detached { consumer }) = next_change_on(&mut rx, &key, Duration::from_secs(2)).await else {
        panic!("the consumer on the killed node was not detached within 2 s: {:?}", t.consumers_on(&key))
    };
    let after = killed.elapsed();
    eprintln!("kill -9 qc: its consumer detached after {after:?}");
    assert_eq!(consumer.tag, "on-qc");
    let left: Vec<String> = t.consumers_on(&key).into_iter().map(|c| c.tag).collect();
    assert_eq!(left, ["on-qb"], "only the dead node's consumer goes");

    drop(revive);
    // The node is back: resyncs see what the management API lists, and nothing comes back from the dead.
    assert!(tracking_events(&t, Duration::from_secs(15)).await, "{}", t.tracking("/"));
    tokio::time::sleep(STATS_LAG).await;
    let left: Vec<String> = t.consumers_on(&key).into_iter().map(|c| c.tag).collect();
    assert_eq!(left, ["on-qb"]);
    cluster.delete_queue(&queue).await;
}

/// The same crash as the operator runs it: the pod's gate condition, written through the (mocked)
/// API by the gate's one pod writer, goes False within 2 s, with no reconcile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_node_holding_a_pods_consumer_closes_its_gate_within_two_seconds() {
    let Some(cluster) =
        Cluster::from_env("killing_the_node_holding_a_pods_consumer_closes_its_gate_within_two_seconds")
    else {
        return;
    };
    let (client, mut api) = mock_client();
    let ctx = Arc::new(Context::new(client, &unique("cluster-gate")));
    let t = ctx.trackers.tracker(&cluster.uri(), None).unwrap();
    assert!(tracking_events(&t, Duration::from_secs(15)).await, "{}", t.tracking("/"));
    let name = unique("gate-crash");
    cluster.quorum_queue(&name).await;
    let p = policy_doc(&name, "queue: {type: quorum}\n  consumers: {deployment: worker, minAttachedSeconds: 0}");
    watched(&ctx, &[&p], &[worker_deployment(json!({"type": "RollingUpdate"}))], &[worker_pod(None)], &[]);
    // Synced and not bound yet: the pod says why it waits, and the worker gets its budget.
    expect_first_condition(&mut api, "WaitingForQueues").await;
    expect_unordered(&mut api, &[("PATCH", "/apis/policy/v1/namespaces/test/poddisruptionbudgets/worker-queueguard")])
        .await;
    ctx.gate
        .on(&kube::runtime::watcher::Event::Apply(serde_json::from_value::<Pod>(worker_pod(Some("False"))).unwrap()));
    let key = QueueKey::new("/", &name);
    let dead_letter_queue = QueueKey::new("/", format!("{name}.dlq"));
    ctx.gate.bind(&ObjectKey::of(&p), Ok(QueueWatch { tracker: t.clone(), queue: key.clone(), dead_letter_queue }));

    // The pod (127.0.0.1, as every client here) consumes through qc.
    let (_conn, ch) = cluster.app(2, "test/worker-abc-1").await;
    let _consumer = ch
        .basic_consume(
            name.as_str().into(),
            "worker-ctag".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    expect_pod_condition(&mut api, "True", "ConsumerAttached").await;
    ctx.gate
        .on(&kube::runtime::watcher::Event::Apply(serde_json::from_value::<Pod>(worker_pod(Some("True"))).unwrap()));

    let killed = Instant::now();
    let revive = kill("qc");
    let written = expect_pod_condition(&mut api, "False", "WaitingForConsumer").await;
    let after = killed.elapsed();
    eprintln!("kill -9 qc: the pod's gate condition written False after {after:?}");
    assert!(after < Duration::from_secs(2), "{after:?}: {written}");
    drop(revive);
    cluster.delete_queue(&name).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_node_the_operator_uses_moves_it_to_the_next_and_it_keeps_reconciling() {
    let Some(cluster) =
        Cluster::from_env("killing_the_node_the_operator_uses_moves_it_to_the_next_and_it_keeps_reconciling")
    else {
        return;
    };
    let pool = BrokerPool::new(unique("cluster"));
    let creds = cluster.credentials();
    let declare = |name: String| {
        let pool = &pool;
        let creds = &creds;
        async move {
            let plan = plan_of(&policy(&name, &format!("{{name: {name}, type: quorum}}")));
            let broker = pass::broker_for_plan(pool, &plan, creds).unwrap();
            let outcome = converge::converge(&plan, &broker, &[], Mode::Declare).await;
            (plan, outcome)
        }
    };
    let (first, outcome) = declare(unique("before-crash")).await;
    assert!(outcome.is_ready(), "{:?}", outcome.ready());
    let trackers = TrackerPool::new(&unique("cluster"));
    let t = cluster.tracker(&trackers);
    assert!(tracking_events(&t, Duration::from_secs(15)).await, "{}", t.tracking("/"));

    // qa is the first address: the declarations and the subscription both live there.
    let killed = Instant::now();
    let revive = kill("qa");
    let (second, outcome) = declare(unique("after-crash")).await;
    assert!(outcome.is_ready(), "declared through the next node: {:?}", outcome.ready());
    eprintln!("kill -9 qa: next policy Ready after {:?}", killed.elapsed());
    let (_, again) = declare(first.queue.clone()).await;
    assert!(again.is_ready(), "the existing quorum queue is still there: {:?}", again.ready());
    assert!(
        eventually(Duration::from_secs(15), || async { t.tracking("/") == Tracking::Events }).await,
        "the subscription moved to another node: {}",
        t.tracking("/")
    );
    eprintln!("kill -9 qa: events flowing again after {:?}", killed.elapsed());

    // Events from the new subscription reach the tracker.
    let key = QueueKey::new("/", &second.queue);
    let _interest = t.watch(key.clone());
    let mut rx = t.subscribe();
    let (_app, ch) = cluster.app(2, "pod-after-failover").await;
    let _late = ch
        .basic_consume(
            second.queue.as_str().into(),
            "late".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    assert!(matches!(next_change_on(&mut rx, &key, Duration::from_secs(2)).await, Some(Change::Attached { .. })));
    drop(revive);
    for plan in [&first, &second] {
        cluster.delete_queue(&plan.queue).await;
        cluster.delete_queue(&plan.dead_letter_queue).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_restart_of_the_broker_during_consumer_rollouts_loses_nothing() {
    let Some(cluster) = Cluster::from_env("a_rolling_restart_of_the_broker_during_consumer_rollouts_loses_nothing")
    else {
        return;
    };
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let scenario = Scenario { quorum: true, until: Some(done.clone()), ..Scenario::new(true, 2, 2) };
    let uri = cluster.uri();
    let rollouts = tokio::spawn(async move { simulation::run(&scenario, &uri).await });
    // Let the first rollouts run on a whole cluster, then restart each node in turn.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let restarting = Instant::now();
    for node in NODES {
        tokio::task::spawn_blocking(move || {
            cluster_script(&["stop-node", node]);
            cluster_script(&["start-node", node]);
        })
        .await
        .unwrap();
    }
    eprintln!("rolling restart of qa, qb, qc took {:?}", restarting.elapsed());
    done.store(true, std::sync::atomic::Ordering::SeqCst);
    // Bounded, so a hang fails here with its cause instead of holding CI until its deadline.
    let report = tokio::time::timeout(Duration::from_secs(180), rollouts)
        .await
        .expect("the rollouts finish within 3 minutes of the restart")
        .unwrap()
        .expect("the rollouts finish");
    eprintln!("{}", simulation::table(std::slice::from_ref(&report)));
    assert!(report.restarts > 2, "rollouts ran throughout the broker restart: {report:?}");
    assert!(report.reconnects > 0, "consumers had to reconnect: {report:?}");
    assert_eq!(report.lost, 0, "every confirmed message is consumed: {report:?}");
    assert_eq!(report.queue_deletions, 0, "{report:?}");
    assert_eq!(report.premature_opens, 0, "{report:?}");
    let slowest = report.gate_overheads.iter().max().copied().unwrap_or_default();
    eprintln!(
        "{} rollouts, {} consumer reconnects, {} messages, slowest gate after an attach {slowest:?}",
        report.restarts, report.reconnects, report.published
    );
    assert!(
        slowest <= STATS_LAG + Duration::from_secs(1),
        "a pod whose consumer had attached waited {slowest:?} for its gate (statistics lag {STATS_LAG:?})"
    );
}

/// Remembers the steps recorded.
#[derive(Default)]
struct Steps(Vec<queueguard::crd::MigrationPhase>);

impl queueguard::migrate::run::Journal for Steps {
    async fn record(&mut self, state: &queueguard::crd::MigrationStatus) -> Result<(), String> {
        self.0.push(state.phase);
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_classic_queue_becomes_a_quorum_queue_on_every_node_with_its_messages() {
    use queueguard::migrate::run::{PolicyMigration, migrate_policy};
    let Some(cluster) = Cluster::from_env("a_classic_queue_becomes_a_quorum_queue_on_every_node_with_its_messages")
    else {
        return;
    };
    let name = unique("cluster-migrate");
    let pool = BrokerPool::new(unique("cluster"));
    let creds = cluster.credentials();
    let classic = plan_of(&policy(&name, &format!("{{name: {name}}}")));
    let broker = pass::broker_for_plan(&pool, &classic, &creds).unwrap();
    assert!(converge::converge(&classic, &broker, &[], Mode::Declare).await.is_ready());
    {
        let (_c, ch) = cluster.app(1, "qgt-preload").await;
        ch.confirm_select(Default::default()).await.unwrap();
        for i in 0..2000 {
            let body = format!("m-{i}");
            ch.basic_publish("".into(), name.as_str().into(), Default::default(), body.as_bytes(), Default::default())
                .await
                .unwrap()
                .await
                .unwrap();
        }
    }

    let quorum = plan_of(&policy(&name, &format!("{{name: {name}, type: quorum, onChange: Migrate}}")));
    let mut steps = Steps::default();
    let migrated =
        migrate_policy(&broker, &quorum, None, &mut steps, &Default::default(), &Default::default()).await.unwrap();
    let PolicyMigration::Moved(state) = migrated else { panic!("not moved: {migrated:?}") };
    assert_eq!((state.moved_out, state.moved_back), (2000, 2000));
    eprintln!(
        "3-node cluster, classic → quorum, 2000 messages: swap window {:?} ms, fenced {:?} ms",
        state.swap_window_millis, state.fenced_millis
    );
    assert!(converge::converge(&quorum, &broker, &[], Mode::Declare).await.is_ready());

    let info = broker.management.queue("/", &name).await.unwrap().unwrap();
    assert_eq!(info.queue_type.as_deref(), Some("quorum"));
    let (_c, ch) = cluster.app(2, "qgt-count").await;
    let passive = QueueDeclareOptions { passive: true, ..Default::default() };
    let counted = ch.queue_declare(name.as_str().into(), passive, FieldTable::default()).await.unwrap();
    assert_eq!(counted.message_count(), 2000, "every message is in the new queue, read from another node");
    let members = eventually(Duration::from_secs(15), || async {
        let q: serde_json::Value = reqwest_get(&cluster, &format!("queues/%2F/{}", enc(&name))).await;
        q["members"].as_array().is_some_and(|m| m.len() == 3)
    });
    assert!(members.await, "a member on each of the three nodes");
    cluster.delete_queue(&name).await;
    cluster.delete_queue(&quorum.dead_letter_queue).await;
}

/// A management API read from the cluster's first node.
async fn reqwest_get(cluster: &Cluster, path: &str) -> serde_json::Value {
    let base = cluster.management.split(',').next().expect("a management endpoint");
    let response = reqwest::Client::new()
        .get(format!("{base}/api/{path}"))
        .basic_auth("guest", Some("guest"))
        .send()
        .await
        .expect("the management API answers");
    response.json().await.unwrap_or_default()
}
