//! The index as the controller drives it: objects and consumer changes in, pod condition patches
//! and policy wake-ups out. No API server, no broker, no sleeps.

use super::*;
use crate::workload::{Object, owner::PodOwner};
use crate::{
    consumers::Change,
    crd::FailurePolicy,
    gate::{
        GateReason,
        pods::{CLOCK_SKEW_MS, GateCondition},
    },
    names::GATE_CONDITION,
};
use k8s_openapi::{
    api::apps::v1::{Deployment, DeploymentSpec},
    apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference},
};

const NOW: i64 = 1_000_000;
const SOURCE: u64 = 7;

#[derive(Default)]
struct Broker {
    consumers: HashMap<QueueKey, Vec<Consumer>>,
    tracking: Option<Tracking>,
}

impl Consumers for Broker {
    fn consumers_on(&self, source: u64, queue: &QueueKey) -> Vec<Consumer> {
        assert_eq!(source, SOURCE);
        self.consumers.get(queue).cloned().unwrap_or_default()
    }

    fn tracking(&self, _: u64, _: &QueueKey) -> Tracking {
        self.tracking.clone().unwrap_or(Tracking::Events)
    }
}

impl Broker {
    fn attach(&mut self, queue: &str, pod_ip: &str, since: i64) {
        self.consumers.entry(q(queue)).or_default().push(consumer(queue, pod_ip, since, since));
    }

    fn detach(&mut self, queue: &str) {
        self.consumers.remove(&q(queue));
    }
}

fn q(name: &str) -> QueueKey {
    QueueKey::new("/", name)
}

fn consumer(queue: &str, peer: &str, since: i64, connected: i64) -> Consumer {
    Consumer {
        queue: q(queue),
        tag: format!("ctag-{queue}-{peer}"),
        channel: format!("{peer}:4000 -> 10.9.9.9:5672 (1)"),
        peer_host: Some(peer.into()),
        connection_name: None,
        prefetch: 10,
        ack_required: true,
        since_ms: since,
        connected_ms: Some(connected),
        node: None,
    }
}

fn plan(min_attached: i32) -> GatePlan {
    crate::testing::gate_plan(min_attached)
}

fn policy(name: &str, selects: Selects, plan: Result<GatePlan, NoGate>) -> PolicyFacts {
    PolicyFacts { key: ObjectKey::new("shop", name), uid: format!("uid-{name}"), selects, plan, deleting: false }
}

/// Deployments labelled tier=consumers.
fn by_tier() -> Selects {
    Selects::Labels {
        selector: Selector::try_from(LabelSelector {
            match_labels: Some([("tier".to_owned(), "consumers".to_owned())].into()),
            ..Default::default()
        })
        .unwrap(),
        kinds: vec![Kind::Deployment],
    }
}

fn guarding_worker(name: &str) -> PolicyFacts {
    policy(name, Selects::Named(Kind::Deployment, "worker".into()), Ok(plan(1)))
}

fn deployment(name: &str, labels: &[(&str, &str)]) -> Workload {
    let labels: BTreeMap<String, String> = labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    Workload::new(Deployment {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some("shop".into()),
            labels: Some(labels.clone()),
            ..Default::default()
        },
        spec: Some(DeploymentSpec {
            replicas: Some(3),
            selector: LabelSelector {
                match_labels: Some([("app".to_owned(), name.to_owned())].into()),
                ..Default::default()
            },
            template: k8s_openapi::api::core::v1::PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some([("app".to_owned(), name.to_owned())].into()),
                    ..Default::default()
                }),
                spec: None,
            },
            ..Default::default()
        }),
        status: None,
    })
}

fn pod(name: &str, ip: &str) -> PodFacts {
    let mut p = crate::testing::pod_facts(name, ip, NOW - 60_000);
    p.containers_ready_since_ms = Some(NOW - 50_000);
    p
}

/// The pod as the watch shows it after the writer's patch.
fn written(mut p: PodFacts, patch: &PodPatch) -> PodFacts {
    p.condition = Some(GateCondition {
        status: patch.attached,
        reason: patch.reason.as_str().into(),
        since_ms: patch.transition_ms,
    });
    p
}

/// An index with the given policies bound to their queue (`orders` for the first, and so on),
/// the `worker` Deployment, and every watch synced.
fn index(policies: Vec<(PolicyFacts, &str)>) -> GateIndex {
    let mut i = GateIndex::default();
    let keys: Vec<(ObjectKey, &str)> = policies.iter().map(|(p, queue)| (p.key.clone(), *queue)).collect();
    i.replace_policies(policies.into_iter().map(|(p, _)| p).collect());
    for (key, queue) in keys {
        let dead_letter_queue = Some(q(&format!("{queue}.dlq")));
        i.bind(&key, Ok(BoundQueue { source: SOURCE, queue: q(queue), dead_letter_queue }));
    }
    i.replace_workloads(Kind::Deployment, vec![deployment("worker", &[("tier", "consumers")])]);
    crate::testing::sync_workload_feeds(&mut i);
    i.replace_budgets(vec![]);
    i.replace_pods(vec![], NOW);
    i
}

/// The pod condition writes of a flush.
fn flush(i: &mut GateIndex, b: &Broker, now: i64) -> Vec<PodPatch> {
    i.flush(b, now)
        .writes
        .into_iter()
        .filter_map(|w| match w {
            Write::Condition(p) => Some(p),
            _ => None,
        })
        .collect()
}

/// The workload writes of a flush (strategy fixes, budgets).
fn workload_writes(i: &mut GateIndex, b: &Broker, now: i64) -> Vec<Write> {
    i.flush(b, now).writes.into_iter().filter(|w| !matches!(w, Write::Condition(_))).collect()
}

fn worker() -> WorkloadKey {
    WorkloadKey::new(Kind::Deployment, "shop", "worker")
}

#[test]
fn two_policies_and_a_worker_attached_to_one_queue_stay_closed_without_a_single_patch() {
    let mut i = index(vec![(guarding_worker("orders"), "orders"), (guarding_worker("events"), "events")]);
    let mut b = Broker::default();
    b.attach("orders", "10.0.0.1", NOW - 30_000);
    i.upsert_pod(pod("worker-1", "10.0.0.1"), NOW);
    let patches = flush(&mut i, &b, NOW);
    let [first] = patches.as_slice() else { panic!("{patches:?}") };
    assert!(!first.attached && first.first, "a new pod says at once why it waits");
    assert_eq!(first.reason, GateReason::WaitingForConsumer);
    assert_eq!(first.message, "waiting for events: no consumer from this pod yet", "it names the queue it misses");
    assert_eq!(first.event(), None, "the first False is told by the condition, not by an Event");
    // Each policy's changes wake the pod again; the verdict stays the same, nothing is written,
    // before the watch shows the condition and after.
    for now in (NOW..NOW + 10_000).step_by(100) {
        i.consumers_changed(SOURCE, &Change::Tracking { vhost: None });
        let seen =
            if now < NOW + 5_000 { pod("worker-1", "10.0.0.1") } else { written(pod("worker-1", "10.0.0.1"), first) };
        i.upsert_pod(seen, now);
        assert_eq!(flush(&mut i, &b, now), vec![]);
    }
    let view = i.policy_view(&ObjectKey::new("shop", "orders"), &b, NOW).unwrap();
    assert_eq!(view.pods[0].waiting_for, ["events"], "orders' status names the queue the pod still misses");
    assert!(view.pods[0].attached_since.is_some() && view.pods[0].counts, "its own queue is attached");
    let view = i.policy_view(&ObjectKey::new("shop", "events"), &b, NOW).unwrap();
    assert!(view.pods[0].attached_since.is_none());
}

#[test]
fn attached_to_both_queues_opens_once_and_one_leaving_closes_once() {
    let mut i = index(vec![(guarding_worker("orders"), "orders"), (guarding_worker("events"), "events")]);
    let mut b = Broker::default();
    b.attach("orders", "10.0.0.1", NOW - 30_000);
    b.attach("events", "10.0.0.1", NOW - 20_000);
    i.upsert_pod(pod("worker-1", "10.0.0.1"), NOW);
    let patches = flush(&mut i, &b, NOW);
    let [open] = patches.as_slice() else { panic!("{patches:?}") };
    assert!(open.attached);
    assert_eq!(open.reason, GateReason::ConsumerAttached);
    assert!(open.message.contains("orders") && open.message.contains("events"), "{}", open.message);
    assert_eq!(open.policies.len(), 2);
    assert_eq!(open.waited_ms, Some(50_000), "from containers ready to open");
    // Written, not yet seen back: no second patch.
    i.consumers_changed(SOURCE, &Change::Tracking { vhost: None });
    assert_eq!(flush(&mut i, &b, NOW + 1), vec![]);
    i.upsert_pod(written(pod("worker-1", "10.0.0.1"), open), NOW + 2);
    assert_eq!(flush(&mut i, &b, NOW + 2), vec![]);

    b.detach("events");
    i.consumers_changed(SOURCE, &Change::Detached { consumer: consumer("events", "10.0.0.1", 0, 0) });
    let patches = flush(&mut i, &b, NOW + 3);
    let [close] = patches.as_slice() else { panic!("{patches:?}") };
    assert!(!close.attached);
    assert_eq!(close.reason, GateReason::WaitingForConsumer);
    assert!(!close.first && close.event().is_some(), "a flip is told by an Event too");
    assert!(close.message.starts_with("waiting for events: no consumer from this pod"), "{}", close.message);
    assert_eq!(close.body()["status"]["conditions"][0]["type"], GATE_CONDITION);
    i.consumers_changed(SOURCE, &Change::Tracking { vhost: None });
    assert_eq!(flush(&mut i, &b, NOW + 4), vec![]);
}

#[test]
fn only_enforce_policies_vote() {
    let mut observe = plan(1);
    observe.mode = GateMode::Observe;
    let mut i = index(vec![
        (guarding_worker("orders"), "orders"),
        (policy("events", Selects::Named(Kind::Deployment, "worker".into()), Ok(observe)), "events"),
    ]);
    let mut b = Broker::default();
    b.attach("orders", "10.0.0.1", NOW - 30_000);
    i.upsert_pod(pod("worker-1", "10.0.0.1"), NOW);
    let patches = flush(&mut i, &b, NOW);
    assert_eq!(patches.len(), 1, "events is observed only: orders alone decides");
    assert!(patches[0].attached);
    assert_eq!(patches[0].policies, [ObjectKey::new("shop", "orders")]);
    let view = i.policy_view(&ObjectKey::new("shop", "events"), &b, NOW).unwrap();
    assert!(view.pods[0].open, "the Observe policy's status shows the pod's real gate");
}

#[test]
fn a_fresh_consumer_waits_out_min_attached_seconds_on_a_timer() {
    let mut i = index(vec![(guarding_worker("orders"), "orders")]);
    let mut b = Broker::default();
    b.attach("orders", "10.0.0.1", NOW - 2_000);
    i.upsert_pod(pod("worker-1", "10.0.0.1"), NOW);
    let patches = flush(&mut i, &b, NOW);
    assert_eq!(
        patches.iter().map(|p| (p.attached, p.reason)).collect::<Vec<_>>(),
        [(false, GateReason::AttachedTooRecently)]
    );
    assert_eq!(i.next_due(), Some(NOW + 3_000));
    i.tick(NOW + 2_999);
    assert_eq!(flush(&mut i, &b, NOW + 2_999), vec![]);
    i.tick(NOW + 3_000);
    let patches = flush(&mut i, &b, NOW + 3_000);
    assert_eq!(patches.len(), 1);
    assert_eq!(i.next_due(), None);
}

#[test]
fn a_reused_ip_never_opens_a_new_pod_for_a_stale_consumer() {
    let mut i = index(vec![(guarding_worker("orders"), "orders")]);
    let mut b = Broker::default();
    // The old holder of 10.0.0.1 connected long ago; its connection outlives it at the broker.
    b.consumers.insert(q("orders"), vec![consumer("orders", "10.0.0.1", NOW - 600_000, NOW - 600_000)]);
    let mut fresh = pod("worker-2", "10.0.0.1");
    fresh.ip_since_ms = Some(NOW - 10_000);
    i.upsert_pod(fresh.clone(), NOW);
    let patches = flush(&mut i, &b, NOW);
    assert!(patches.len() == 1 && !patches[0].attached, "the stale consumer is not the new pod's: {patches:?}");
    let view = i.policy_view(&ObjectKey::new("shop", "orders"), &b, NOW).unwrap();
    assert_eq!((view.stale, view.unmatched), (1, 0));
    assert!(view.pods[0].attached_since.is_none());
    // The new pod's own consumer, connected after it got the address, counts.
    b.consumers.get_mut(&q("orders")).unwrap().push(consumer("orders", "10.0.0.1", NOW - 8_000, NOW - 9_000));
    i.consumers_changed(SOURCE, &Change::Tracking { vhost: None });
    let patches = flush(&mut i, &b, NOW);
    assert_eq!(patches.len(), 1);
    assert!(patches[0].attached);
    // Within the clock skew allowance a consumer still counts.
    let mut skewed = pod("worker-3", "10.0.0.3");
    skewed.ip_since_ms = Some(NOW - 10_000);
    b.attach("orders", "10.0.0.3", NOW - 10_000 - CLOCK_SKEW_MS);
    i.upsert_pod(skewed, NOW);
    assert_eq!(flush(&mut i, &b, NOW).len(), 1);
}

#[test]
fn a_pod_seen_without_start_time_dates_its_address_from_first_sight() {
    let mut i = index(vec![(guarding_worker("orders"), "orders")]);
    let mut b = Broker::default();
    b.consumers.insert(q("orders"), vec![consumer("orders", "10.0.0.1", NOW - 600_000, NOW - 600_000)]);
    let mut p = pod("worker-1", "10.0.0.1");
    p.ip_since_ms = None;
    i.upsert_pod(p.clone(), NOW);
    assert!(flush(&mut i, &b, NOW).iter().all(|p| !p.attached));
    i.upsert_pod(p, NOW + 5_000);
    let view = i.policy_view(&ObjectKey::new("shop", "orders"), &b, NOW + 5_000).unwrap();
    assert_eq!(view.stale, 1, "first seen at NOW, not at the later update");
}

#[test]
fn pods_are_one_by_uid_and_terminal_pods_hold_no_address() {
    let by_tier = by_tier();
    // Two policies picking the same Deployment, by name and by label.
    let mut i = index(vec![(guarding_worker("orders"), "orders"), (policy("by-tier", by_tier, Ok(plan(1))), "orders")]);
    let mut b = Broker::default();
    b.attach("orders", "10.0.0.1", NOW - 30_000);
    let mut evicted = pod("worker-old", "10.0.0.1");
    evicted.terminal = true;
    i.upsert_pod(evicted, NOW);
    i.upsert_pod(pod("worker-1", "10.0.0.1"), NOW);
    i.upsert_pod(pod("worker-1", "10.0.0.1"), NOW);
    let patches = flush(&mut i, &b, NOW);
    assert_eq!(patches.len(), 1, "one pod, one patch, and the Failed pod does not make 10.0.0.1 ambiguous");
    assert_eq!(patches[0].pod, "worker-1");
    let view = i.policy_view(&ObjectKey::new("shop", "by-tier"), &b, NOW).unwrap();
    assert_eq!(view.pods.iter().map(|p| p.name.as_str()).collect::<Vec<_>>(), ["worker-1"]);
    assert!(view.ambiguous_ips.is_empty());
    assert_eq!(i.guarding("uid-worker-1").len(), 2);
    assert_eq!(i.guarded(&ObjectKey::new("shop", "by-tier")), [worker()]);

    // A second live pod on the same address (hostNetwork): ambiguous, never guessed.
    let mut twin = pod("worker-2", "10.0.0.1");
    twin.uid = "uid-twin".into();
    i.upsert_pod(twin, NOW);
    let patches = flush(&mut i, &b, NOW);
    let closed = patches.iter().find(|p| p.pod == "worker-1").expect("worker-1 closes");
    assert!(!closed.attached, "its consumer can no longer be told apart");
    assert_eq!(closed.message, "waiting for orders: no consumer from this pod yet", "one queue, named once");
    assert!(patches.iter().any(|p| p.pod == "worker-2" && p.first && !p.attached), "the twin's first word");
    let view = i.policy_view(&ObjectKey::new("shop", "orders"), &b, NOW).unwrap();
    assert_eq!(view.ambiguous_ips, ["10.0.0.1"]);
}

#[test]
fn failure_policy_closed_holds_what_it_cannot_see_and_open_lets_through_after_the_timeout() {
    let mut i = index(vec![(guarding_worker("orders"), "orders")]);
    let b = Broker {
        tracking: Some(Tracking::Unavailable("reading the consumers of vhost '/': 401".into())),
        ..Default::default()
    };
    let mut opened = pod("worker-1", "10.0.0.1");
    opened.condition = Some(GateCondition { status: true, reason: "ConsumerAttached".into(), since_ms: NOW - 100_000 });
    i.upsert_pod(opened, NOW);
    i.upsert_pod(pod("worker-2", "10.0.0.2"), NOW);
    let patches = flush(&mut i, &b, NOW);
    let [first] = patches.as_slice() else { panic!("{patches:?}") };
    assert_eq!(
        (first.pod.as_str(), first.attached, first.reason),
        ("worker-2", false, GateReason::TrackingUnavailable),
        "nothing seen, nothing changed: the open pod stays open, the new one says why it waits"
    );
    assert!(first.message.contains("401"), "{}", first.message);
    i.upsert_pod(written(pod("worker-2", "10.0.0.2"), first), NOW);

    let mut open = plan(1);
    open.failure_policy = FailurePolicy::Open;
    i.upsert_policy(policy("orders", Selects::Named(Kind::Deployment, "worker".into()), Ok(open)));
    let patches = flush(&mut i, &b, NOW + 700_000);
    let [p] = patches.as_slice() else { panic!("{patches:?}") };
    assert_eq!((p.pod.as_str(), p.reason), ("worker-2", GateReason::BrokerUnreachable));
    let event = p.event().unwrap();
    assert_eq!(event.reason.as_str(), "GateFailedOpen");
    assert!(event.warning);
}

#[test]
fn unbound_and_invalid_policies_hold_and_unguarded_pods_open() {
    let mut i = index(vec![(guarding_worker("orders"), "orders")]);
    let b = Broker::default();
    i.bind(&ObjectKey::new("shop", "orders"), Err(Unbound::NotReady("Secret 'shop/rabbitmq' not found".into())));
    let mut p = pod("worker-1", "10.0.0.1");
    p.condition = Some(GateCondition { status: false, reason: "NoConsumer".into(), since_ms: NOW });
    i.upsert_pod(p.clone(), NOW);
    assert_eq!(flush(&mut i, &b, NOW), vec![]);
    let view = i.policy_view(&ObjectKey::new("shop", "orders"), &b, NOW).unwrap();
    assert!(matches!(&view.tracking, Tracking::Unavailable(why) if why.contains("Secret")));

    i.upsert_policy(policy(
        "orders",
        Selects::Named(Kind::Deployment, "worker".into()),
        Err(NoGate::Invalid("spec.queue.expires: invalid".into())),
    ));
    assert_eq!(flush(&mut i, &b, NOW), vec![], "an invalid policy holds its pods as they are");

    i.remove_policy(&ObjectKey::new("shop", "orders"));
    let patches = flush(&mut i, &b, NOW);
    let [open] = patches.as_slice() else { panic!("{patches:?}") };
    assert_eq!(open.reason, GateReason::NotGuarded, "a gate nobody guards would hold the pod for ever");
}

#[test]
fn nothing_is_written_before_every_watch_has_synced() {
    let mut i = GateIndex::default();
    let b = Broker::default();
    i.replace_pods(vec![pod("worker-1", "10.0.0.1")], NOW);
    i.replace_workloads(Kind::Deployment, vec![deployment("worker", &[])]);
    crate::testing::sync_workload_feeds(&mut i);
    i.replace_budgets(vec![]);
    assert_eq!(flush(&mut i, &b, NOW), vec![], "policies not listed yet: the pod only looks unguarded");
    i.replace_policies(vec![guarding_worker("orders")]);
    i.mark_all();
    let patches = flush(&mut i, &b, NOW);
    let [first] = patches.as_slice() else { panic!("{patches:?}") };
    assert_eq!(
        (first.attached, first.reason),
        (false, GateReason::WaitingForQueues),
        "guarded, its queue not bound yet"
    );
    assert!(first.message.contains("not reconciled yet"), "{}", first.message);
}

#[test]
fn deleting_pods_are_left_alone_and_a_failed_write_is_retried() {
    let mut i = index(vec![(guarding_worker("orders"), "orders")]);
    let mut b = Broker::default();
    b.attach("orders", "10.0.0.1", NOW - 30_000);
    let mut leaving = pod("worker-0", "10.0.0.9");
    leaving.deleting = true;
    i.upsert_pod(leaving, NOW);
    i.upsert_pod(pod("worker-1", "10.0.0.1"), NOW);
    let patches = flush(&mut i, &b, NOW);
    assert_eq!(patches.len(), 1);
    i.write_failed(&Write::Condition(patches[0].clone()), NOW);
    assert_eq!(flush(&mut i, &b, NOW + 10), vec![], "not before the retry delay");
    assert_eq!(i.next_due(), Some(NOW + RETRY_MS));
    i.tick(NOW + RETRY_MS);
    assert_eq!(flush(&mut i, &b, NOW + RETRY_MS).len(), 1);
}

#[test]
fn policies_are_woken_by_their_pods_deployments_and_queues() {
    let mut i = index(vec![
        (guarding_worker("orders"), "orders"),
        (policy("other", Selects::Nothing, Err(NoGate::NoConsumers)), "other"),
    ]);
    let b = Broker::default();
    i.flush(&b, NOW);
    i.upsert_pod(pod("worker-1", "10.0.0.1"), NOW);
    assert_eq!(i.flush(&b, NOW).wake, BTreeSet::from([ObjectKey::new("shop", "orders")]));
    i.consumers_changed(SOURCE, &Change::QueueDeleted { queue: q("other") });
    assert_eq!(
        i.flush(&b, NOW).wake,
        BTreeSet::from([ObjectKey::new("shop", "other")]),
        "a queue deleted behind its back"
    );
    i.consumers_changed(SOURCE, &Change::QueueDeleted { queue: q("orders.dlq") });
    assert_eq!(
        i.flush(&b, NOW).wake,
        BTreeSet::from([ObjectKey::new("shop", "orders")]),
        "its dead-letter queue deleted behind its back"
    );
    i.upsert_workload(deployment("worker", &[("tier", "web")]));
    assert_eq!(i.flush(&b, NOW).wake, BTreeSet::from([ObjectKey::new("shop", "orders")]));
}

fn budget(name: &str, ours: bool, selects_app: &str) -> BudgetFacts {
    let mut labels = BTreeMap::new();
    if ours {
        labels.insert(crate::names::MANAGED_BY.0.to_owned(), crate::names::MANAGED_BY.1.to_owned());
        labels.insert("queueguard.io/deployment".to_owned(), selects_app.to_owned());
    }
    BudgetFacts::from_budget(&PodDisruptionBudget {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some("shop".into()),
            labels: Some(labels),
            owner_references: ours.then(|| vec![OwnerReference { uid: "uid-orders".into(), ..Default::default() }]),
            ..Default::default()
        },
        spec: Some(k8s_openapi::api::policy::v1::PodDisruptionBudgetSpec {
            selector: Some(LabelSelector {
                match_labels: Some([("app".to_owned(), selects_app.to_owned())].into()),
                ..Default::default()
            }),
            ..Default::default()
        }),
        status: None,
    })
}

#[test]
fn one_budget_per_deployment_with_the_strictest_min_attached_and_none_beside_anothers() {
    let mut i = index(vec![
        (policy("orders", Selects::Named(Kind::Deployment, "worker".into()), Ok(plan(1))), "orders"),
        (policy("events", Selects::Named(Kind::Deployment, "worker".into()), Ok(plan(2))), "events"),
    ]);
    let b = Broker::default();
    let Budget::Want(want) = i.budget_for(&worker()) else { panic!() };
    assert_eq!(want.metadata.name.as_deref(), Some("worker-queueguard"));
    assert_eq!(
        want.spec.as_ref().unwrap().min_available,
        Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(2)),
        "the strictest minAttached"
    );
    assert_eq!(want.metadata.owner_references.as_ref().unwrap().len(), 2);
    // Two policies, one budget applied once; not again until the watch shows it.
    let writes = workload_writes(&mut i, &b, NOW);
    assert!(matches!(writes.as_slice(), [Write::ApplyBudget { budget, .. }] if **budget == *want), "{writes:?}");
    i.consumers_changed(SOURCE, &Change::Tracking { vhost: None });
    assert_eq!(workload_writes(&mut i, &b, NOW), vec![]);
    i.upsert_budget(BudgetFacts::from_budget(&want));
    assert_eq!(workload_writes(&mut i, &b, NOW), vec![], "seen back as applied");

    // Someone else's budget over the same pods: two budgets would make every eviction fail, so
    // the operator's goes.
    i.upsert_budget(budget("team-pdb", false, "worker"));
    assert_eq!(i.budget_for(&worker()), Budget::Foreign(vec!["team-pdb".into()]));
    let writes = workload_writes(&mut i, &b, NOW);
    assert!(
        matches!(writes.as_slice(), [Write::DeleteBudget { budget, .. }] if budget.name == "worker-queueguard"),
        "{writes:?}"
    );
    i.remove_budget(&ObjectKey::new("shop", "worker-queueguard"));
    i.remove_budget(&ObjectKey::new("shop", "team-pdb"));
    i.upsert_budget(budget("unrelated", false, "web"));
    assert!(matches!(i.budget_for(&worker()), Budget::Want(_)));

    // A deleting policy no longer owns it; without any, there is none.
    let mut leaving = policy("events", Selects::Named(Kind::Deployment, "worker".into()), Ok(plan(2)));
    leaving.deleting = true;
    i.upsert_policy(leaving);
    let Budget::Want(want) = i.budget_for(&worker()) else { panic!() };
    assert_eq!(want.metadata.owner_references.as_ref().unwrap().len(), 1);
    let mut no_pdb = plan(1);
    no_pdb.pod_disruption_budget = false;
    i.upsert_policy(policy("orders", Selects::Named(Kind::Deployment, "worker".into()), Ok(no_pdb)));
    assert_eq!(i.budget_for(&worker()), Budget::None);
}

#[test]
fn two_policies_fix_a_workloads_strategy_once_and_a_failed_write_is_retried() {
    let mut i = index(vec![
        (policy("orders", Selects::Named(Kind::Deployment, "worker".into()), Ok(plan(1))), "orders"),
        (policy("events", Selects::Named(Kind::Deployment, "worker".into()), Ok(plan(3))), "events"),
    ]);
    let b = Broker::default();
    // The fixture's worker made unsafe: Recreate stops all three pods at once.
    let mut recreate = deployment("worker", &[("tier", "consumers")]);
    let Object::Deployment(d) = Arc::make_mut(&mut recreate.object) else { unreachable!() };
    d.spec.as_mut().unwrap().strategy =
        Some(k8s_openapi::api::apps::v1::DeploymentStrategy { type_: Some("Recreate".into()), rolling_update: None });
    i.upsert_workload(recreate.clone());
    let writes = workload_writes(&mut i, &b, NOW);
    let fixes: Vec<&StrategyFix> = writes
        .iter()
        .filter_map(|w| match w {
            Write::Strategy(f) => Some(f),
            _ => None,
        })
        .collect();
    let [fix] = fixes.as_slice() else { panic!("{writes:?}") };
    assert_eq!(fix.policies.len(), 2, "one write for both policies");
    assert_eq!(fix.body["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"], 0);
    // Other changes wake the workload; nothing is sent twice while the watch lags.
    i.upsert_workload(recreate.clone());
    i.consumers_changed(SOURCE, &Change::Tracking { vhost: None });
    assert!(workload_writes(&mut i, &b, NOW).iter().all(|w| !matches!(w, Write::Strategy(_))));
    // The write failed: tried again after the retry delay, and only then.
    i.write_failed(&Write::Strategy((*fix).clone()), NOW);
    assert!(workload_writes(&mut i, &b, NOW + 10).iter().all(|w| !matches!(w, Write::Strategy(_))));
    i.tick(NOW + RETRY_MS);
    let again = workload_writes(&mut i, &b, NOW + RETRY_MS);
    assert!(again.iter().any(|w| matches!(w, Write::Strategy(_))), "{again:?}");
    // Observe mode, or manageStrategy off: reported only, never written.
    let mut observe = plan(3);
    observe.mode = GateMode::Observe;
    i.upsert_policy(policy("events", Selects::Named(Kind::Deployment, "worker".into()), Ok(observe)));
    let mut hands_off = plan(1);
    hands_off.manage_strategy = false;
    i.upsert_policy(policy("orders", Selects::Named(Kind::Deployment, "worker".into()), Ok(hands_off)));
    i.upsert_workload(recreate);
    assert!(workload_writes(&mut i, &b, NOW + 2 * RETRY_MS).iter().all(|w| !matches!(w, Write::Strategy(_))));
}

#[test]
fn pods_find_their_statefulset_and_their_rollout_through_owner_references() {
    let canary = WorkloadKey::new(Kind::Rollout, "shop", "canary");
    let mut i = index(vec![
        (policy("shards", Selects::Named(Kind::StatefulSet, "shard".into()), Ok(plan(1))), "shards"),
        (policy("canaries", Selects::Named(Kind::Rollout, "canary".into()), Ok(plan(1))), "canaries"),
    ]);
    let mut b = Broker::default();
    b.attach("shards", "10.0.0.1", NOW - 30_000);
    let meta =
        |name: &str| ObjectMeta { name: Some(name.into()), namespace: Some("shop".into()), ..Default::default() };
    let shard = k8s_openapi::api::apps::v1::StatefulSet { metadata: meta("shard"), ..Default::default() };
    i.upsert_workload(Workload::new(shard));
    let canary_rollout: crate::workload::rollout::Rollout = serde_json::from_value(
        serde_json::json!({"metadata": {"name": "canary", "namespace": "shop"}, "spec": {"strategy": {}}}),
    )
    .unwrap();
    i.upsert_workload(Workload::new(canary_rollout));
    let mut sts_pod = pod("shard-0", "10.0.0.1");
    sts_pod.owner = Some(PodOwner::StatefulSet("shard".into()));
    i.upsert_pod(sts_pod, NOW);
    let patches = flush(&mut i, &b, NOW);
    assert!(matches!(patches.as_slice(), [p] if p.pod == "shard-0" && p.attached), "{patches:?}");
    assert_eq!(i.guarding("uid-shard-0"), [ObjectKey::new("shop", "shards")]);

    // A Rollout's pod, seen before its ReplicaSet: unguarded until the ReplicaSet names its owner.
    let mut rollout_pod = pod("canary-6f7-x", "10.0.0.2");
    rollout_pod.owner = Some(PodOwner::ReplicaSet("canary-6f7".into()));
    i.upsert_pod(rollout_pod, NOW);
    let _ = flush(&mut i, &b, NOW);
    assert!(i.guarding("uid-canary-6f7-x").is_empty());
    i.upsert_replica_set(ReplicaSetFacts { key: ObjectKey::new("shop", "canary-6f7"), owner: Some(canary.clone()) });
    assert_eq!(i.guarding("uid-canary-6f7-x"), [ObjectKey::new("shop", "canaries")]);
    let patches = flush(&mut i, &b, NOW);
    assert!(matches!(patches.as_slice(), [p] if p.pod == "canary-6f7-x" && p.first && !p.attached), "{patches:?}");
}

/// A pod let through by `failurePolicy: Open` stays open when it comes back through the watch:
/// judged again from scratch it was closed, then reopened, every attachTimeout.
#[test]
fn a_pod_opened_by_failure_policy_open_stays_open_without_a_consumer() {
    let mut open = plan(1);
    open.failure_policy = FailurePolicy::Open;
    let timeout = open.attach_timeout.as_millis() as i64;
    let mut i = index(vec![(policy("orders", Selects::Named(Kind::Deployment, "worker".into()), Ok(open)), "orders")]);
    let mut b = Broker::default();
    i.upsert_pod(pod("worker-1", "10.0.0.1"), NOW);
    let first = flush(&mut i, &b, NOW);
    let [waiting] = first.as_slice() else { panic!("{first:?}") };
    assert!(!waiting.attached);
    i.upsert_pod(written(pod("worker-1", "10.0.0.1"), waiting), NOW);
    let at = NOW + timeout;
    let opened = flush(&mut i, &b, at);
    let [let_through] = opened.as_slice() else { panic!("{opened:?}") };
    assert_eq!((let_through.attached, let_through.reason), (true, GateReason::AttachTimeoutExpired));
    i.upsert_pod(written(pod("worker-1", "10.0.0.1"), let_through), at);
    for later in [at + 1, at + timeout, at + 3 * timeout] {
        assert_eq!(flush(&mut i, &b, later), vec![], "no flip at {later}");
    }
    // Its consumer attaching is said once (the status stays True); losing it afterwards closes
    // the gate as for any pod.
    b.attach("orders", "10.0.0.1", at + 10);
    i.consumers_changed(SOURCE, &Change::Tracking { vhost: None });
    let attached = flush(&mut i, &b, at + 4 * timeout);
    let [attached] = attached.as_slice() else { panic!("{attached:?}") };
    assert_eq!((attached.attached, attached.reason, attached.waited_ms), (true, GateReason::ConsumerAttached, None));
    i.upsert_pod(written(pod("worker-1", "10.0.0.1"), attached), at + 4 * timeout);
    assert_eq!(flush(&mut i, &b, at + 4 * timeout), vec![]);
    b.detach("orders");
    i.consumers_changed(SOURCE, &Change::Tracking { vhost: None });
    let closed = flush(&mut i, &b, at + 4 * timeout + 1);
    let [closed] = closed.as_slice() else { panic!("{closed:?}") };
    assert_eq!((closed.attached, closed.reason), (false, GateReason::WaitingForConsumer));
}

/// Where the broker user cannot read other users' connections (RabbitMQ lists them only to a
/// `monitoring` user), every consumer's connection age is unknown: it does not open a gate, but
/// it does not close an open one either, and status says which tag the user needs.
#[test]
fn a_consumer_of_unknown_connection_age_holds_an_open_gate_and_opens_none() {
    let mut i = index(vec![(guarding_worker("orders"), "orders")]);
    let mut b = Broker::default();
    let mut undated = consumer("orders", "10.0.0.1", NOW - 30_000, NOW - 30_000);
    undated.connected_ms = None;
    let mut twin = undated.clone();
    twin.peer_host = Some("10.0.0.2".into());
    twin.channel = "10.0.0.2:4000 -> 10.9.9.9:5672 (1)".into();
    b.consumers.insert(q("orders"), vec![undated, twin]);
    let mut opened = pod("worker-1", "10.0.0.1");
    opened.condition = Some(GateCondition { status: true, reason: "ConsumerAttached".into(), since_ms: NOW - 40_000 });
    i.upsert_pod(opened, NOW);
    i.upsert_pod(pod("worker-2", "10.0.0.2"), NOW);
    let patches = flush(&mut i, &b, NOW);
    let [first] = patches.as_slice() else { panic!("the open pod is held: {patches:?}") };
    assert_eq!((first.pod.as_str(), first.attached), ("worker-2", false), "an undated consumer opens nothing");
    assert!(first.message.contains("monitoring"), "{}", first.message);
    let view = i.policy_view(&ObjectKey::new("shop", "orders"), &b, NOW).unwrap();
    assert_eq!(view.undated, 2);
    let check = super::super::consumers_check(&plan(1), &view, 1, 2);
    assert!(check.message.contains("2 consumers' connections are not listed") && check.message.contains("monitoring"));
}

/// A policy whose queue is not bound yet goes through the vote as unavailable: failurePolicy
/// Open lets its pods through after attachTimeout (it held them for ever); one that stands back
/// for the Topology Operator does not vote at all.
#[test]
fn an_unbound_policy_lets_through_by_failure_policy_open_and_one_standing_back_does_not_vote() {
    let mut open = plan(1);
    open.failure_policy = FailurePolicy::Open;
    let timeout = open.attach_timeout.as_millis() as i64;
    let orders = ObjectKey::new("shop", "orders");
    let mut i = index(vec![(policy("orders", Selects::Named(Kind::Deployment, "worker".into()), Ok(open)), "orders")]);
    let b = Broker::default();
    i.bind(&orders, Err(Unbound::NotReady("Secret 'shop/rabbitmq' not found".into())));
    i.upsert_pod(pod("worker-1", "10.0.0.1"), NOW);
    let first = flush(&mut i, &b, NOW);
    let [waiting] = first.as_slice() else { panic!("{first:?}") };
    assert_eq!((waiting.attached, waiting.reason), (false, GateReason::WaitingForQueues));
    assert!(waiting.message.contains("Secret"), "{}", waiting.message);
    i.upsert_pod(written(pod("worker-1", "10.0.0.1"), waiting), NOW);
    let opened = flush(&mut i, &b, NOW + timeout);
    let [let_through] = opened.as_slice() else { panic!("{opened:?}") };
    assert_eq!((let_through.attached, let_through.reason), (true, GateReason::BrokerUnreachable));

    let mut j = index(vec![
        (guarding_worker("orders"), "orders"),
        (
            policy(
                "events",
                Selects::Named(Kind::Deployment, "worker".into()),
                Err(NoGate::StandsBack("managed by Queue 'events'".into())),
            ),
            "events",
        ),
    ]);
    let mut attached = Broker::default();
    attached.attach("orders", "10.0.0.1", NOW - 40_000);
    j.upsert_pod(pod("worker-1", "10.0.0.1"), NOW);
    let patches = flush(&mut j, &attached, NOW);
    let [p] = patches.as_slice() else { panic!("{patches:?}") };
    assert_eq!((p.attached, p.reason), (true, GateReason::ConsumerAttached), "only orders votes: {}", p.message);
}

/// A write the API server keeps refusing (a 403 from an admission policy, a 422) is tried again
/// less and less often, up to once every 5 minutes, not every second for ever; once one lands
/// and is seen back, the next failure starts again at a second.
#[test]
fn a_write_that_keeps_failing_is_retried_less_and_less_often() {
    let mut i = index(vec![(guarding_worker("orders"), "orders")]);
    let mut b = Broker::default();
    b.attach("orders", "10.0.0.1", NOW - 30_000);
    i.upsert_pod(pod("worker-1", "10.0.0.1"), NOW);
    let mut now = NOW;
    let mut delays = Vec::new();
    for _ in 0..12 {
        let patches = flush(&mut i, &b, now);
        let [patch] = patches.as_slice() else { panic!("{patches:?}") };
        i.write_failed(&Write::Condition(patch.clone()), now);
        assert_eq!(flush(&mut i, &b, now), vec![], "not before its delay");
        let due = i.next_due().unwrap();
        delays.push((due - now) / 1000);
        now = due;
        i.tick(now);
    }
    assert_eq!(delays, [1, 2, 4, 8, 16, 32, 64, 128, 256, 300, 300, 300]);
    let patches = flush(&mut i, &b, now);
    let [patch] = patches.as_slice() else { panic!("{patches:?}") };
    i.upsert_pod(written(pod("worker-1", "10.0.0.1"), patch), now);
    b.detach("orders");
    i.consumers_changed(SOURCE, &Change::Tracking { vhost: None });
    let closing = flush(&mut i, &b, now + 1);
    let [closing] = closing.as_slice() else { panic!("{closing:?}") };
    i.write_failed(&Write::Condition(closing.clone()), now + 1);
    assert_eq!(flush(&mut i, &b, now + 1), vec![]);
    assert_eq!(i.next_due(), Some(now + 1 + RETRY_MS), "landed and seen back: a second again");
}

/// A pod whose Deployment the watches have not delivered yet is not judged: for a policy that
/// picks workloads by label it would look unguarded, be opened, and closed a moment later.
#[test]
fn a_pod_is_not_judged_before_its_workload_arrives() {
    let by_tier = by_tier();
    let mut i = index(vec![(policy("by-tier", by_tier, Ok(plan(1))), "orders")]);
    let b = Broker::default();
    let late = WorkloadKey::new(Kind::Deployment, "shop", "late");
    i.upsert_replica_set(ReplicaSetFacts { key: ObjectKey::new("shop", "late-abc"), owner: Some(late) });
    let mut p = pod("late-abc-1", "10.0.0.7");
    p.owner = Some(PodOwner::ReplicaSet("late-abc".into()));
    i.upsert_pod(p, NOW);
    assert_eq!(flush(&mut i, &b, NOW), vec![], "its Deployment is not known yet");
    i.upsert_workload(deployment("late", &[("tier", "consumers")]));
    let patches = flush(&mut i, &b, NOW + 10);
    let [first] = patches.as_slice() else { panic!("{patches:?}") };
    assert_eq!((first.attached, first.reason), (false, GateReason::WaitingForConsumer), "guarded from its first word");
}
