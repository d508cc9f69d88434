//! `queueguard status` (also `kubectl queueguard status`): one row per QueuePolicy, read from the
//! status the operator wrote: the queue, the workload it guards, its depth, consumers attached
//! against expected, the rollout phase and what each waiting pod waits for. Rows and their rendering are pure; `list`
//! reads the cluster.

use crate::{
    crd::{MigrationPhase, QueuePolicy, RolloutPhase},
    gate::guards::Selects,
    status::{self, ConditionType},
};
use k8s_openapi::jiff::Timestamp;
use kube::{Api, Client, ResourceExt, api::ListParams};
use serde::Serialize;

/// Which policies to list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scope {
    Namespace(String),
    AllNamespaces,
}

/// One policy, as `status` shows it.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Row {
    pub namespace: String,
    pub policy: String,
    pub queue: String,
    /// The consumer workload it guards (`StatefulSet/shard`), or `selector`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub workload: Option<String>,
    /// The Ready condition: True, False or Unknown (no status yet).
    pub ready: String,
    /// Why it is not Ready.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Messages ready on the queue, as last seen.
    pub depth: Option<i64>,
    pub unacknowledged: Option<i64>,
    /// With spec.consumers: pods whose consumer is attached, and pods expected.
    pub attached: Option<i32>,
    pub expected: Option<i32>,
    pub rollout: Option<RolloutPhase>,
    pub waiting: Vec<Waiting>,
    /// A queue migration under way, or refused (a completed one is not shown).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub migration: Option<Migration>,
}

/// A queue migration's step and counts.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Migration {
    pub queue: String,
    pub phase: MigrationPhase,
    pub moved_out: i64,
    pub moved_back: i64,
    pub message: String,
}

/// A pod held back by the gate.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Waiting {
    pub pod: String,
    pub since: Option<Timestamp>,
    /// The queues still missing its consumer.
    pub waiting_for: Vec<String>,
}

pub fn row(p: &QueuePolicy) -> Row {
    let status = p.status.clone().unwrap_or_default();
    let ready = status::find(&status.conditions, ConditionType::Ready);
    let is_true = ready.is_some_and(|c| c.status == "True");
    Row {
        namespace: p.namespace().unwrap_or_default(),
        policy: p.name_any(),
        queue: status
            .queue
            .as_ref()
            .map(|q| q.name.clone())
            .or(p.spec.queue.name.clone())
            .unwrap_or_else(|| p.name_any()),
        workload: match Selects::of(p) {
            Selects::Named(kind, name) => Some(format!("{}/{name}", kind.as_str())),
            Selects::Labels { .. } => Some("selector".into()),
            Selects::Nothing => None,
        },
        ready: ready.map_or_else(|| "Unknown".to_owned(), |c| c.status.clone()),
        reason: ready.filter(|_| !is_true).map(|c| c.reason.clone()),
        depth: status.queue.as_ref().and_then(|q| q.messages_ready),
        unacknowledged: status.queue.as_ref().and_then(|q| q.messages_unacknowledged),
        attached: status.consumers.as_ref().map(|c| c.attached),
        expected: status.consumers.as_ref().map(|c| c.expected),
        rollout: status.rollout.as_ref().map(|r| r.phase),
        waiting: status
            .rollout
            .iter()
            .flat_map(|r| &r.waiting_pods)
            .map(|w| Waiting {
                pod: w.name.clone(),
                since: w.since.as_ref().map(|t| t.0),
                waiting_for: w.waiting_for.clone(),
            })
            .collect(),
        migration: status.migration.as_ref().filter(|m| m.phase != MigrationPhase::Completed).map(|m| Migration {
            queue: m.queue.clone(),
            phase: m.phase,
            moved_out: m.moved_out,
            moved_back: m.moved_back,
            message: m.message.clone(),
        }),
    }
}

/// Rows sorted by namespace and name.
pub fn rows(policies: &[QueuePolicy]) -> Vec<Row> {
    let mut rows: Vec<Row> = policies.iter().map(row).collect();
    rows.sort_by(|a, b| (&a.namespace, &a.policy).cmp(&(&b.namespace, &b.policy)));
    rows
}

/// The table: one line per policy, then one indented line per waiting pod.
pub fn table(rows: &[Row], now: Timestamp) -> String {
    if rows.is_empty() {
        return "No QueuePolicies found.\n".to_owned();
    }
    let dash = || "-".to_owned();
    let header = ["NAMESPACE", "POLICY", "QUEUE", "WORKLOAD", "READY", "DEPTH", "UNACKED", "CONSUMERS", "ROLLOUT"]
        .map(str::to_owned);
    let cells: Vec<[String; 9]> = rows
        .iter()
        .map(|r| {
            [
                r.namespace.clone(),
                r.policy.clone(),
                r.queue.clone(),
                r.workload.clone().unwrap_or_else(dash),
                match &r.reason {
                    Some(reason) => format!("{} ({reason})", r.ready),
                    None => r.ready.clone(),
                },
                r.depth.map_or_else(dash, |d| d.to_string()),
                r.unacknowledged.map_or_else(dash, |d| d.to_string()),
                match (r.attached, r.expected) {
                    (Some(a), Some(e)) => format!("{a}/{e}"),
                    _ => dash(),
                },
                r.rollout.map_or_else(dash, |p| <&str>::from(p).to_owned()),
            ]
        })
        .collect();
    let widths: Vec<usize> =
        (0..9).map(|i| cells.iter().map(|c| c[i].len()).chain([header[i].len()]).max().unwrap_or(0)).collect();
    let line = |cols: &[String; 9]| {
        let text: Vec<String> = cols.iter().zip(&widths).map(|(c, w)| format!("{c:<w$}")).collect();
        text.join("   ").trim_end().to_owned() + "\n"
    };
    let mut out = line(&header);
    for (r, c) in rows.iter().zip(&cells) {
        out += &line(c);
        if let Some(m) = &r.migration {
            out += &format!(
                "  migrating {}: {}, moved out {}, moved back {}: {}\n",
                m.queue,
                m.phase.as_str(),
                m.moved_out,
                m.moved_back,
                m.message
            );
        }
        for w in &r.waiting {
            let since = w.since.map(|s| format!(" for {}", ago(now, s))).unwrap_or_default();
            let queues = if w.waiting_for.is_empty() { "its consumer".to_owned() } else { w.waiting_for.join(", ") };
            out += &format!("  pod {} waits{since} for {queues}\n", w.pod);
        }
    }
    out
}

fn ago(now: Timestamp, since: Timestamp) -> String {
    let secs = now.duration_since(since).as_secs().max(0);
    match secs {
        0..120 => format!("{secs}s"),
        120..7200 => format!("{}m", secs / 60),
        _ => format!("{}h", secs / 3600),
    }
}

/// The policies in scope, as rows.
pub async fn list(client: Client, scope: &Scope) -> Result<Vec<Row>, kube::Error> {
    let api: Api<QueuePolicy> = match scope {
        Scope::Namespace(ns) => Api::namespaced(client, ns),
        Scope::AllNamespaces => Api::all(client),
    };
    Ok(rows(&api.list(&ListParams::default()).await?.items))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(yaml: &str) -> QueuePolicy {
        serde_yaml_ng::from_str(yaml).unwrap()
    }

    const WAITING: &str = r#"
apiVersion: queueguard.io/v1alpha1
kind: QueuePolicy
metadata: {name: orders, namespace: shop}
spec:
  broker: {secretRef: {name: rabbitmq}}
  queue: {name: orders-v2}
  consumers: {deployment: order-worker}
status:
  conditions:
    - {type: Ready, status: "True", reason: Ready, message: ok, lastTransitionTime: "2026-12-05T10:00:00Z"}
  queue: {name: orders-v2, vhost: /, messagesReady: 12, messagesUnacknowledged: 3, consumers: 1}
  consumers: {attached: 1, expected: 2, tracking: Events}
  rollout:
    phase: WaitingForAttach
    waitingPods:
      - {name: order-worker-7d9-x2, since: "2026-12-05T10:00:00Z", waitingFor: [orders-v2, billing]}
  migration: {phase: Draining, queue: orders-v2, movedOut: 1200, movedBack: 0, message: "moving the messages of 'orders-v2' into 'orders-v2.queueguard-migrating'"}
"#;

    #[test]
    fn a_policy_with_a_waiting_pod_shows_what_the_pod_waits_for() {
        let now: Timestamp = "2026-12-05T10:00:42Z".parse().unwrap();
        let broken = policy(
            "apiVersion: queueguard.io/v1alpha1\nkind: QueuePolicy\nmetadata: {name: billing, namespace: shop}\nspec:\n  broker: {secretRef: {name: rabbitmq}}\n  queue: {}\nstatus:\n  conditions:\n    - {type: Ready, status: \"False\", reason: SecretNotFound, message: gone, lastTransitionTime: \"2026-12-05T10:00:00Z\"}\n",
        );
        let fresh = policy(
            "apiVersion: queueguard.io/v1alpha1\nkind: QueuePolicy\nmetadata: {name: audit, namespace: ops}\nspec:\n  broker: {secretRef: {name: rabbitmq}}\n  queue: {}\n",
        );
        let rows = rows(&[policy(WAITING), fresh, broken]);
        assert_eq!(rows.iter().map(|r| r.policy.as_str()).collect::<Vec<_>>(), ["audit", "billing", "orders"]);
        assert_eq!(
            table(&rows, now),
            "\
NAMESPACE   POLICY    QUEUE       WORKLOAD                  READY                    DEPTH   UNACKED   CONSUMERS   ROLLOUT
ops         audit     audit       -                         Unknown                  -       -         -           -
shop        billing   billing     -                         False (SecretNotFound)   -       -         -           -
shop        orders    orders-v2   Deployment/order-worker   True                     12      3         1/2         WaitingForAttach
  migrating orders-v2: Draining, moved out 1200, moved back 0: moving the messages of 'orders-v2' into 'orders-v2.queueguard-migrating'
  pod order-worker-7d9-x2 waits for 42s for orders-v2, billing
"
        );
        let json = serde_json::to_value(&rows[2]).unwrap();
        assert_eq!(
            json,
            serde_json::json!({
                "namespace": "shop", "policy": "orders", "queue": "orders-v2", "workload": "Deployment/order-worker", "ready": "True",
                "depth": 12, "unacknowledged": 3, "attached": 1, "expected": 2, "rollout": "WaitingForAttach",
                "waiting": [{"pod": "order-worker-7d9-x2", "since": "2026-12-05T10:00:00Z", "waitingFor": ["orders-v2", "billing"]}],
                "migration": {"queue": "orders-v2", "phase": "Draining", "movedOut": 1200, "movedBack": 0,
                              "message": "moving the messages of 'orders-v2' into 'orders-v2.queueguard-migrating'"}
            })
        );
        assert_eq!(table(&[], now), "No QueuePolicies found.\n");
    }
}
