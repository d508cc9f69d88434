//! End to end on a real cluster (kind or k3d) with RabbitMQ inside it: the operator runs
//! in-process against the cluster, a real third-party consumer (RabbitMQ PerfTest) runs in the
//! guarded Deployment, and rolling restarts must keep the queue and all its messages.
//!
//! Skipped unless KUBECONFIG is set. See README "End-to-end on a real cluster": apply
//! tests/e2e/rabbitmq.yaml, port-forward it, then
//!   QUEUEGUARD_E2E_BROKER=amqp://guest:guest@127.0.0.1:5672/%2F \
//!   QUEUEGUARD_E2E_POD_BROKER=amqp://guest:guest@rabbitmq.queueguard-e2e:5672/%2F \
//!   cargo nextest run --test e2e_cluster --no-capture

mod common;

use clap::Parser;
use common::unique;
use k8s_openapi::{
    api::{
        apps::v1::Deployment,
        core::v1::{Namespace, Pod, Secret},
        policy::v1::PodDisruptionBudget,
    },
    apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
};
use kube::{
    Api, Client, CustomResourceExt, ResourceExt,
    api::{DeleteParams, ListParams, Patch, PatchParams, PostParams},
};
use lapin::{BasicProperties, Connection, ConnectionProperties, options::*, types::FieldTable};
use queueguard::{
    broker::uri::BrokerUri,
    cli::{Cli, Command},
    consumers::{Change, QueueKey, TrackerPool},
    controller,
    crd::QueuePolicy,
};
use serde_json::json;
use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

struct Env {
    broker: String,
    management: Option<String>,
    pod_broker: String,
}

fn env() -> Option<Env> {
    if std::env::var_os("KUBECONFIG").is_none() {
        eprintln!(
            "skipped: set KUBECONFIG (and QUEUEGUARD_E2E_BROKER, QUEUEGUARD_E2E_POD_BROKER) to run against a real cluster"
        );
        return None;
    }
    let (Ok(broker), Ok(pod_broker)) =
        (std::env::var("QUEUEGUARD_E2E_BROKER"), std::env::var("QUEUEGUARD_E2E_POD_BROKER"))
    else {
        panic!(
            "KUBECONFIG is set: QUEUEGUARD_E2E_BROKER (the broker as the test reaches it) and QUEUEGUARD_E2E_POD_BROKER (as pods reach it) are needed too"
        );
    };
    Some(Env { broker, management: std::env::var("QUEUEGUARD_E2E_MANAGEMENT").ok(), pod_broker })
}

async fn wait_for<F, Fut>(what: &str, timeout: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    while !check().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rolling_restarts_on_a_real_cluster_keep_the_queue_and_every_message() {
    let Some(env) = env() else { return };
    queueguard::tls::install_crypto_provider();
    let client = Client::try_default().await.expect("cluster from KUBECONFIG");

    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    crds.patch(
        "queuepolicies.queueguard.io",
        &PatchParams::apply("queueguard-e2e").force(),
        &Patch::Apply(QueuePolicy::crd()),
    )
    .await
    .expect("CRD applied");
    wait_for("the CRD to be established", Duration::from_secs(60), || async {
        crds.get("queuepolicies.queueguard.io")
            .await
            .ok()
            .and_then(|c| c.status)
            .and_then(|s| s.conditions)
            .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Established" && c.status == "True"))
    })
    .await;

    let ns = unique("e2e").replace('.', "-");
    let namespaces: Api<Namespace> = Api::all(client.clone());
    namespaces
        .create(&PostParams::default(), &serde_json::from_value(json!({"metadata": {"name": ns}})).unwrap())
        .await
        .unwrap();
    let queue = "orders";

    let secrets: Api<Secret> = Api::namespaced(client.clone(), &ns);
    let mut data = json!({"uri": env.broker});
    if let Some(m) = &env.management {
        data["managementUri"] = json!(m);
    }
    secrets
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": "rabbitmq"}, "stringData": data})).unwrap(),
        )
        .await
        .unwrap();

    // An unsafe strategy on purpose: the operator must make it safe.
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns);
    let worker = json!({
        "metadata": {"name": "worker"},
        "spec": {
            "replicas": 2,
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": {"app": "worker"}},
            "template": {
                "metadata": {"labels": {"app": "worker"}},
                "spec": {
                    "readinessGates": [{"conditionType": "queueguard.io/consumer-attached"}],
                    "terminationGracePeriodSeconds": 10,
                    "containers": [{
                        "name": "consumer",
                        "image": "pivotalrabbitmq/perf-test:latest",
                        "args": ["--uri", env.pod_broker, "--queue", queue, "--predeclared", "--producers", "0", "--consumers", "1", "--qos", "10"],
                    }],
                },
            },
        },
    });
    deployments.create(&PostParams::default(), &serde_json::from_value(worker).unwrap()).await.unwrap();

    let policies: Api<QueuePolicy> = Api::namespaced(client.clone(), &ns);
    let policy = json!({
        "apiVersion": "queueguard.io/v1alpha1", "kind": "QueuePolicy",
        "metadata": {"name": "orders"},
        "spec": {"broker": {"secretRef": {"name": "rabbitmq"}}, "queue": {"name": queue}, "consumers": {"deployment": "worker", "minAttachedSeconds": 2}},
    });
    policies.create(&PostParams::default(), &serde_json::from_value(policy).unwrap()).await.unwrap();

    let argv =
        ["queueguard", "run", "--namespace", &ns, "--connection-name", "queueguard-e2e", "--http-addr", "127.0.0.1:0"];
    let Command::Run(args) = Cli::try_parse_from(argv).unwrap().command else { unreachable!("parsed as run") };
    let operator = tokio::spawn(controller::run(args.config().unwrap()));

    wait_for("the policy to be Ready with 2 consumers attached", Duration::from_secs(300), || async {
        policies.get("orders").await.ok().and_then(|p| p.status).is_some_and(|s| {
            let ready = s.conditions.iter().any(|c| c.type_ == "Ready" && c.status == "True");
            ready && s.consumers.is_some_and(|c| c.attached == 2)
        })
    })
    .await;
    let d = deployments.get("worker").await.unwrap();
    let strategy = d.spec.unwrap().strategy.unwrap();
    assert_eq!(strategy.type_.as_deref(), Some("RollingUpdate"), "the Recreate strategy was made safe");
    let pdbs: Api<PodDisruptionBudget> = Api::namespaced(client.clone(), &ns);
    let pdb = pdbs.get("worker-queueguard").await.expect("the Deployment's one PDB exists");
    assert_eq!(
        pdb.spec.unwrap().min_available,
        Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(1))
    );

    // Watch the broker for deletions of the queue while publishing and restarting.
    let uri = BrokerUri::parse(&env.broker, env.management.as_deref()).unwrap();
    let pool = TrackerPool::new("queueguard-e2e-observer");
    let tracker = pool.tracker(&uri, None).unwrap();
    assert!(tracker.wait_synced("/", Duration::from_secs(30)).await);
    let key = QueueKey::new(uri.vhost(), queue);
    let mut changes = tracker.subscribe();

    let published = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let publisher = {
        let (uri, published, stop) = (env.broker.clone(), published.clone(), stop.clone());
        tokio::spawn(async move {
            let conn = Connection::connect(&uri, ConnectionProperties::default()).await.unwrap();
            let ch = conn.create_channel().await.unwrap();
            ch.confirm_select(ConfirmSelectOptions::default()).await.unwrap();
            let mut seq = 0u64;
            while !stop.load(Ordering::SeqCst) {
                let confirm = ch
                    .basic_publish(
                        "".into(),
                        queue.into(),
                        BasicPublishOptions { mandatory: true, ..Default::default() },
                        seq.to_string().as_bytes(),
                        BasicProperties::default().with_delivery_mode(2),
                    )
                    .await
                    .unwrap()
                    .await
                    .unwrap();
                assert!(
                    confirm.is_ack() && confirm.take_message().is_none(),
                    "message {seq} was not routed to the queue"
                );
                published.fetch_add(1, Ordering::SeqCst);
                seq += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };

    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    for restart in 0..3 {
        let patch = json!({"spec": {"template": {"metadata": {"annotations": {"queueguard.io/e2e-restart": restart.to_string()}}}}});
        deployments.patch("worker", &PatchParams::default(), &Patch::Strategic(patch)).await.unwrap();
        wait_for("the rollout to finish", Duration::from_secs(300), || async {
            let d = deployments.get("worker").await.unwrap();
            let (generation, status) = (d.metadata.generation, d.status.unwrap_or_default());
            status.observed_generation == generation
                && status.updated_replicas == Some(2)
                && status.ready_replicas == Some(2)
                && status.replicas == Some(2)
        })
        .await;
        for pod in pods.list(&ListParams::default().labels("app=worker")).await.unwrap() {
            let conditions = pod.status.clone().and_then(|s| s.conditions).unwrap_or_default();
            let gate = conditions
                .iter()
                .find(|c| c.type_ == "queueguard.io/consumer-attached")
                .expect("the gate condition is set");
            assert_eq!(
                (gate.status.as_str(), gate.reason.as_deref()),
                ("True", Some("ConsumerAttached")),
                "{}",
                pod.name_any()
            );
        }
    }
    stop.store(true, Ordering::SeqCst);
    publisher.await.unwrap();

    while let Ok(change) = changes.try_recv() {
        assert!(
            !matches!(change, Change::QueueDeleted { ref queue } if queue == &key),
            "the queue was deleted during a rollout"
        );
    }
    // Everything published was routed to the queue (mandatory publishing); the queue drains.
    let conn = Connection::connect(&env.broker, ConnectionProperties::default()).await.unwrap();
    let ch = conn.create_channel().await.unwrap();
    wait_for("the queue to drain", Duration::from_secs(120), || async {
        let passive = QueueDeclareOptions { passive: true, ..Default::default() };
        ch.queue_declare(queue.into(), passive, FieldTable::default()).await.is_ok_and(|q| q.message_count() == 0)
    })
    .await;
    eprintln!(
        "published {} messages across 3 gated rolling restarts; queue never deleted, drained",
        published.load(Ordering::SeqCst)
    );

    operator.abort();
    namespaces.delete(&ns, &DeleteParams::default()).await.unwrap();
}
