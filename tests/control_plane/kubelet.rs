//! A stand-in kubelet for the control plane of `scripts/control-plane.sh`, which has none: it
//! binds each new pod of its namespace, writes the status a kubelet would (Running, a loopback
//! `podIP`, `ContainersReady`, and `Ready` only once every readiness gate is True), runs the
//! pod's consumer against the real broker, and on deletion stops that consumer gracefully
//! (cancel, close) before removing the pod. The real Deployment, ReplicaSet and StatefulSet
//! controllers do the rest.
//!
//! A pod's consumer reads the queue named by its first container's `QUEUE` environment
//! variable, after `BOOT_MS` (its start-up), with prefetch 10 and manual acks, on a connection
//! named `<namespace>/<pod>` (policies here match by connection name: every client connects from
//! 127.0.0.1). Each acknowledged message's id is recorded.

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::{api::core::v1::Pod, jiff::Timestamp};
use kube::{
    Api, Client, ResourceExt,
    api::{DeleteParams, Patch, PatchParams, PostParams},
    runtime::{WatchStreamExt, watcher},
};
use lapin::{
    Connection, ConnectionProperties,
    options::{BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicQosOptions},
    types::FieldTable,
};
use serde_json::json;
use std::{
    collections::{BTreeSet, HashMap},
    sync::{Arc, Mutex},
    time::Duration,
};
use tokio::{sync::oneshot, task::JoinHandle};

/// What the pods' consumers acknowledged, by message id.
pub type Acked = Arc<Mutex<Vec<String>>>;

/// Consumers attached now, and the fewest since [`Attached::watch_from_now`].
#[derive(Default)]
pub struct Attached {
    now: Mutex<(usize, usize)>,
}

impl Attached {
    fn change(&self, up: bool) {
        let mut n = self.now.lock().unwrap();
        n.0 = if up { n.0 + 1 } else { n.0.saturating_sub(1) };
        n.1 = n.1.min(n.0);
    }

    pub fn watch_from_now(&self) {
        let mut n = self.now.lock().unwrap();
        n.1 = n.0;
    }

    pub fn fewest(&self) -> usize {
        self.now.lock().unwrap().1
    }
}

pub struct Kubelet {
    task: JoinHandle<()>,
    pub acked: Acked,
    pub attached: Arc<Attached>,
}

impl Drop for Kubelet {
    fn drop(&mut self) {
        self.task.abort();
    }
}

struct Running {
    stop: oneshot::Sender<()>,
    consumer: JoinHandle<()>,
}

impl Kubelet {
    pub fn start(client: Client, namespace: &str, broker: &str) -> Self {
        let (acked, attached) = (Acked::default(), Arc::new(Attached::default()));
        let api: Api<Pod> = Api::namespaced(client, namespace);
        let task = tokio::spawn(run(api, broker.to_owned(), acked.clone(), attached.clone()));
        Self { task, acked, attached }
    }
}

async fn run(api: Api<Pod>, broker: String, acked: Acked, attached: Arc<Attached>) {
    let mut running: HashMap<String, Running> = HashMap::new();
    let mut bound: BTreeSet<String> = BTreeSet::new();
    let mut next_ip = 1u32;
    let mut events = watcher(api.clone(), watcher::Config::default()).default_backoff().applied_objects().boxed();
    while let Ok(Some(pod)) = events.try_next().await {
        let (name, uid) = (pod.name_any(), pod.uid().unwrap_or_default());
        if pod.metadata.deletion_timestamp.is_some() {
            if let Some(r) = running.remove(&uid) {
                let _ = r.stop.send(());
                let _ = r.consumer.await;
            }
            let gone = DeleteParams { grace_period_seconds: Some(0), ..DeleteParams::default() };
            let _ = api.delete(&name, &gone).await;
            continue;
        }
        let spec = pod.spec.clone().unwrap_or_default();
        if spec.node_name.is_none() {
            if !bound.insert(uid.clone()) {
                continue; // bound already; the watch has not shown it yet
            }
            let binding = json!({"apiVersion": "v1", "kind": "Binding", "metadata": {"name": name},
                                 "target": {"apiVersion": "v1", "kind": "Node", "name": "stand-in"}});
            let post = PostParams::default();
            let bound = api.create_subresource::<_, serde_json::Value>("binding", &name, &post, &binding);
            if let Err(e) = bound.await {
                eprintln!("kubelet: binding {name}: {e}");
            }
            continue; // the bound pod comes back through the watch
        }
        if !running.contains_key(&uid) {
            // One address per pod, never reused in a run.
            let ip = format!("127.0.{}.{}", 1 + next_ip / 250, 1 + next_ip % 250);
            next_ip += 1;
            let env = |key: &str| spec.containers.first()?.env.as_ref()?.iter().find(|e| e.name == key)?.value.clone();
            let queue = env("QUEUE").unwrap_or_default();
            let boot = Duration::from_millis(env("BOOT_MS").and_then(|v| v.parse().ok()).unwrap_or(0));
            let connection = format!("{}/{name}", pod.namespace().unwrap_or_default());
            let (stop, stopped) = oneshot::channel();
            let consumer = tokio::spawn(consume(
                broker.clone(),
                connection,
                queue,
                boot,
                acked.clone(),
                attached.clone(),
                stopped,
            ));
            running.insert(uid.clone(), Running { stop, consumer });
            let now = Timestamp::now().to_string();
            let status = json!({"status": {
                "phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}], "hostIP": "127.0.0.1", "startTime": now,
                "conditions": [
                    {"type": "PodScheduled", "status": "True", "lastTransitionTime": now},
                    {"type": "Initialized", "status": "True", "lastTransitionTime": now},
                    {"type": "ContainersReady", "status": "True", "lastTransitionTime": now},
                    {"type": "Ready", "status": ready(&pod, true), "lastTransitionTime": now},
                ],
                "containerStatuses": [{"name": spec.containers.first().map(|c| c.name.clone()).unwrap_or_default(),
                    "ready": true, "restartCount": 0, "image": "stand-in", "imageID": "stand-in",
                    "started": true, "state": {"running": {"startedAt": now}}}],
            }});
            if let Err(e) = api.patch_status(&name, &PatchParams::default(), &Patch::Strategic(status)).await {
                eprintln!("kubelet: status of {name}: {e}");
            }
            continue;
        }
        // A readiness gate changed: Ready follows, as the kubelet's status manager does.
        let want = ready(&pod, true);
        let have = condition(&pod, "Ready").unwrap_or("Unknown");
        if want != have {
            let now = Timestamp::now().to_string();
            let status =
                json!({"status": {"conditions": [{"type": "Ready", "status": want, "lastTransitionTime": now}]}});
            if let Err(e) = api.patch_status(&name, &PatchParams::default(), &Patch::Strategic(status)).await {
                eprintln!("kubelet: Ready of {name}: {e}");
            }
        }
    }
}

fn condition<'a>(pod: &'a Pod, kind: &str) -> Option<&'a str> {
    let conditions = pod.status.as_ref()?.conditions.as_ref()?;
    conditions.iter().find(|c| c.type_ == kind).map(|c| c.status.as_str())
}

/// Ready: the containers are, and every readiness gate's condition is True.
fn ready(pod: &Pod, containers_ready: bool) -> &'static str {
    let gates: BTreeSet<&str> = pod
        .spec
        .as_ref()
        .and_then(|s| s.readiness_gates.as_ref())
        .map(|g| g.iter().map(|g| g.condition_type.as_str()).collect())
        .unwrap_or_default();
    let open = gates.iter().all(|g| condition(pod, g) == Some("True"));
    if containers_ready && open { "True" } else { "False" }
}

/// The pod's consumer: reconnects until told to stop, then cancels and closes.
async fn consume(
    broker: String,
    connection: String,
    queue: String,
    boot: Duration,
    acked: Acked,
    attached: Arc<Attached>,
    mut stopped: oneshot::Receiver<()>,
) {
    tokio::select! {
        () = tokio::time::sleep(boot) => {}
        _ = &mut stopped => return,
    }
    loop {
        let props = ConnectionProperties::default().with_connection_name(connection.clone().into());
        let attempt = async {
            let conn = Connection::connect(&broker, props).await?;
            let ch = conn.create_channel().await?;
            ch.basic_qos(10, BasicQosOptions::default()).await?;
            let deliveries = ch
                .basic_consume(
                    queue.as_str().into(),
                    "worker".into(),
                    BasicConsumeOptions::default(),
                    FieldTable::default(),
                )
                .await?;
            Ok::<_, lapin::Error>((conn, ch, deliveries))
        };
        let (conn, ch, mut deliveries) = match attempt.await {
            Ok(c) => c,
            Err(e) => {
                eprintln!("kubelet: consumer {connection}: {e}");
                tokio::select! {
                    () = tokio::time::sleep(Duration::from_millis(500)) => continue,
                    _ = &mut stopped => return,
                }
            }
        };
        attached.change(true);
        loop {
            tokio::select! {
                _ = &mut stopped => {
                    attached.change(false);
                    let _ = ch.basic_cancel("worker".into(), BasicCancelOptions::default()).await;
                    let _ = conn.close(200, "pod stopped".into()).await;
                    return;
                }
                next = deliveries.next() => match next {
                    Some(Ok(d)) => {
                        let id = d.properties.message_id().as_ref().map(|s| s.to_string()).unwrap_or_default();
                        if d.ack(BasicAckOptions::default()).await.is_ok() {
                            acked.lock().unwrap().push(id);
                        }
                    }
                    _ => {
                        attached.change(false);
                        break;
                    }
                },
            }
        }
    }
}
