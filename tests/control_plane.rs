//! Opt-in: the operator on a real control plane (`scripts/control-plane.sh`: kube-apiserver and
//! kube-controller-manager of Kubernetes 1.36, whose Deployment, ReplicaSet and StatefulSet
//! controllers replace the pods), a stand-in kubelet (`control_plane/kubelet.rs`) and the real
//! broker. Ignored, and shown as ignored, unless run with `--run-ignored all` beside a running
//! control plane (`scripts/test.sh` does so when `QUEUEGUARD_CONTROL_PLANE` and `KUBECONFIG`
//! are set, as `scripts/control-plane.sh env` prints them).

mod common;
#[path = "control_plane/kubelet.rs"]
mod kubelet;

use common::{
    traffic::{Route, Traffic},
    *,
};
use k8s_openapi::api::{apps::v1::Deployment, core::v1::Namespace};
use kube::{
    Api, Client,
    api::{DeleteParams, Patch, PatchParams, PostParams},
};
use serde_json::json;
use std::{
    process::{Child, Command},
    time::Duration,
};

/// A namespace of its own, the CRDs, the broker's Secret, the operator (as a child process of
/// the built binary) and the stand-in kubelet.
struct Cluster {
    client: Client,
    namespace: String,
    operator: Child,
    kubelet: kubelet::Kubelet,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = self.operator.kill();
        let _ = self.operator.wait();
        let _ = Command::new("kubectl").args(["delete", "namespace", &self.namespace, "--wait=false"]).output();
    }
}

impl Cluster {
    async fn start() -> Self {
        std::env::var("KUBECONFIG").expect("KUBECONFIG names the control plane (scripts/control-plane.sh env)");
        let client = Client::try_default().await.expect("the control plane answers");
        let crds = Command::new("kubectl")
            .args(["apply", "--server-side", "--force-conflicts", "-f", concat!(env!("CARGO_MANIFEST_DIR"), "/crds")])
            .output()
            .unwrap();
        assert!(crds.status.success(), "{}", String::from_utf8_lossy(&crds.stderr));
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos();
        let namespace = format!("qgcp-{nanos:x}");
        let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": namespace}})).unwrap();
        Api::<Namespace>::all(client.clone()).create(&PostParams::default(), &ns).await.unwrap();
        let secret = json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "rabbitmq"},
                            "stringData": {"uri": broker_uri(), "managementUri": management_base()}});
        Api::<k8s_openapi::api::core::v1::Secret>::namespaced(client.clone(), &namespace)
            .create(&PostParams::default(), &serde_json::from_value(secret).unwrap())
            .await
            .unwrap();
        let operator = Command::new(env!("CARGO_BIN_EXE_queueguard"))
            .args(["run", "--http-addr", "127.0.0.1:0", "--namespaces", &namespace, "--connection-name", &namespace])
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let kubelet = kubelet::Kubelet::start(client.clone(), &namespace, &broker_uri());
        Self { client, namespace, operator, kubelet }
    }

    fn apply(&self, doc: serde_json::Value) {
        let text = serde_json::to_string(&doc).unwrap();
        let mut child = Command::new("kubectl")
            .args(["apply", "--server-side", "-n", &self.namespace, "-f", "-"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        use std::io::Write;
        child.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
        assert!(child.wait().unwrap().success(), "kubectl apply {text}");
    }

    /// Waits until the Deployment's rollout is complete: every replica updated and available.
    async fn rolled_out(&self, name: &str, within: Duration) -> bool {
        let api: Api<Deployment> = Api::namespaced(self.client.clone(), &self.namespace);
        eventually(within, || async {
            let Ok(d) = api.get(name).await else { return false };
            let want = d.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1);
            let s = d.status.unwrap_or_default();
            s.observed_generation >= d.metadata.generation
                && s.updated_replicas == Some(want)
                && s.available_replicas == Some(want)
                && s.replicas == Some(want)
        })
        .await
    }

    async fn restart(&self, name: &str, round: usize) {
        let api: Api<Deployment> = Api::namespaced(self.client.clone(), &self.namespace);
        let patch = json!({"spec": {"template": {"metadata": {"annotations": {"test/restart": round.to_string()}}}}});
        api.patch(name, &PatchParams::default(), &Patch::Merge(patch)).await.unwrap();
    }
}

fn worker(queue: &str, replicas: i32) -> serde_json::Value {
    json!({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "worker"},
        "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": "worker"}},
            "template": {"metadata": {"labels": {"app": "worker"}},
                "spec": {"readinessGates": [{"conditionType": "queueguard.io/consumer-attached"}],
                    "containers": [{"name": "worker", "image": "stand-in",
                        "env": [{"name": "QUEUE", "value": queue}, {"name": "BOOT_MS", "value": "1500"}]}]}}}})
}

/// Three rolling restarts of a guarded Deployment, through the real Deployment and ReplicaSet
/// controllers, under a publisher with confirms: every confirmed message is consumed or still in
/// the queue, and the queue is never deleted.
#[tokio::test]
#[ignore = "needs a real control plane: scripts/control-plane.sh start, then scripts/test.sh"]
async fn guarded_rolling_restarts_of_a_deployment_lose_nothing() {
    let cluster = Cluster::start().await;
    let queue = unique("cp-orders");
    cluster.apply(
        json!({"apiVersion": "queueguard.io/v1alpha1", "kind": "QueuePolicy", "metadata": {"name": "orders"},
        "spec": {"broker": {"secretRef": {"name": "rabbitmq"}}, "queue": {"name": queue},
                 "consumers": {"deployment": "worker", "minAttachedSeconds": 1, "matchBy": "ConnectionName"}}}),
    );
    assert!(eventually(Duration::from_secs(30), || exists(&queue)).await, "the operator declared the queue");
    cluster.apply(worker(&queue, 2));
    assert!(cluster.rolled_out("worker", Duration::from_secs(60)).await, "the first pods open their gates");
    let route = Route { exchange: String::new(), routing_key: queue.clone(), tag: "cp", stop_after: None };
    let mut traffic = Traffic::start(&broker_uri(), &queue, &[route], 0, Duration::from_millis(5), []).await;
    cluster.kubelet.attached.watch_from_now();
    for round in 1..=3 {
        cluster.restart("worker", round).await;
        assert!(cluster.rolled_out("worker", Duration::from_secs(120)).await, "rollout {round} completes");
        assert!(exists(&queue).await, "the queue survives rollout {round}");
    }
    let fewest = cluster.kubelet.attached.fewest();
    let (confirmed, ..) = traffic.stop_publishing().await;
    // Every confirmed message is acknowledged by a worker (the management API's counts lag by
    // its statistics interval, so the workers' own record is what is counted).
    let acked =
        || -> std::collections::HashSet<String> { cluster.kubelet.acked.lock().unwrap().iter().cloned().collect() };
    let all_acked = || async { confirmed.iter().all(|id| acked().contains(id)) };
    let _ = eventually(Duration::from_secs(30), all_acked).await;
    let acked = acked();
    let lost: Vec<&String> = confirmed.iter().filter(|id| !acked.contains(*id)).collect();
    eprintln!(
        "control plane: {} confirmed, {} acknowledged, {} lost, fewest consumers attached {fewest}; the queue holds {:?} (ready, unacknowledged)",
        confirmed.len(),
        acked.len(),
        lost.len(),
        counts(&queue).await
    );
    assert!(confirmed.len() > 100, "traffic ran: {}", confirmed.len());
    assert!(fewest >= 1, "a consumer was attached at every moment of the rollouts (fewest {fewest})");
    assert!(
        lost.is_empty(),
        "{} of {} confirmed messages lost: {:?}",
        lost.len(),
        confirmed.len(),
        &lost[..lost.len().min(5)]
    );
    let api: Api<Deployment> = Api::namespaced(cluster.client.clone(), &cluster.namespace);
    let _ = api.delete("worker", &DeleteParams::default()).await;
    delete_queues(&[&queue, &format!("{queue}.dlq")]).await;
    mgmt_delete(&format!("policies/%2F/queueguard.{}.orders", cluster.namespace)).await;
}
