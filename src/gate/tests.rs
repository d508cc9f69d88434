//! Table tests of the gate's decisions, the pure pipeline end to end: observed state into the
//! index, pod condition patches and the policy's report out. No cluster, no broker.

use super::{
    index::{BoundQueue, Consumers, GateIndex, ObjectKey, PolicyFacts, Write},
    pods::{GateCondition, PodFacts},
    *,
};
use crate::{
    consumers::{Consumer, QueueKey},
    crd::{FailurePolicy, GateMode, PodGate, RolloutPhase, TrackingMode},
    gate::guards::Selects,
    plan::GatePlan,
    workload::{Kind, Workload},
};
use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec, DeploymentStatus, DeploymentStrategy};

const NOW: i64 = 1_000_000;
const MIN_MS: i64 = 5_000;

fn plan() -> GatePlan {
    crate::testing::gate_plan(1)
}

fn deployment(replicas: i32) -> Deployment {
    Deployment {
        metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
            name: Some("worker".into()),
            namespace: Some("shop".into()),
            generation: Some(1),
            ..Default::default()
        },
        spec: Some(DeploymentSpec { replicas: Some(replicas), ..Default::default() }),
        status: Some(DeploymentStatus {
            observed_generation: Some(1),
            replicas: Some(replicas),
            updated_replicas: Some(replicas),
            ..Default::default()
        }),
    }
}

fn pod(i: u8) -> PodFacts {
    let mut p = crate::testing::pod_facts(&format!("worker-{i}"), &format!("10.0.0.{i}"), 0);
    p.uid = format!("uid-{i}");
    p.containers_ready_since_ms = Some(NOW - 1_000);
    p
}

fn open(mut p: PodFacts, since_ms: i64) -> PodFacts {
    p.condition = Some(GateCondition { status: true, reason: GateReason::ConsumerAttached.as_str().into(), since_ms });
    p
}

fn queue() -> QueueKey {
    QueueKey::new("/", "orders")
}

fn consumer_from(i: u8, since_ms: i64) -> Consumer {
    Consumer {
        queue: queue(),
        tag: format!("ctag-{i}"),
        channel: format!("10.0.0.{i}:4000 -> 10.9.9.9:5672 (1)"),
        peer_host: Some(format!("10.0.0.{i}")),
        connection_name: None,
        prefetch: 10,
        ack_required: true,
        since_ms,
        connected_ms: Some(since_ms),
        node: None,
    }
}

struct Seen(Vec<Consumer>, Tracking);

impl Consumers for Seen {
    fn consumers_on(&self, _: u64, q: &QueueKey) -> Vec<Consumer> {
        self.0.iter().filter(|c| &c.queue == q).cloned().collect()
    }

    fn tracking(&self, _: u64, _: &QueueKey) -> Tracking {
        self.1.clone()
    }
}

struct Outcome {
    patches: Vec<PodPatch>,
    writes: Vec<Write>,
    report: Report,
}

fn run(
    plan: &GatePlan,
    deployments: &[Deployment],
    pods: &[PodFacts],
    consumers: &[Consumer],
    tracking: Tracking,
) -> Outcome {
    let key = ObjectKey::new("shop", "orders");
    let mut index = GateIndex::default();
    let selects = Selects::Named(Kind::Deployment, "worker".into());
    index.replace_policies(vec![PolicyFacts {
        key: key.clone(),
        uid: "u".into(),
        selects,
        plan: Ok(plan.clone()),
        deleting: false,
    }]);
    index.bind(&key, Ok(BoundQueue { source: 1, queue: queue(), dead_letter_queue: None }));
    index.replace_workloads(Kind::Deployment, deployments.iter().cloned().map(Workload::new).collect());
    crate::testing::sync_workload_feeds(&mut index);
    index.replace_budgets(vec![]);
    index.replace_pods(pods.to_vec(), NOW);
    let seen = Seen(consumers.to_vec(), tracking);
    let (patches, writes) =
        index.flush(&seen, NOW).writes.into_iter().partition::<Vec<_>, _>(|w| matches!(w, Write::Condition(_)));
    let patches = patches
        .into_iter()
        .filter_map(|w| match w {
            Write::Condition(p) => Some(p),
            _ => None,
        })
        .collect();
    let view = index.policy_view(&key, &seen, NOW).unwrap();
    Outcome { patches, writes, report: report(plan, &view, None, NOW) }
}

/// No flip: at most each new pod's first word, False.
fn no_flip(d: &Outcome) -> bool {
    d.patches.iter().all(|p| p.first && !p.attached)
}

fn patch_of<'a>(d: &'a Outcome, pod: &str) -> Option<&'a PodPatch> {
    d.patches.iter().find(|p| p.pod == pod)
}

#[test]
fn a_consumer_attached_long_enough_opens_the_gate() {
    let d = run(&plan(), &[deployment(1)], &[pod(1)], &[consumer_from(1, NOW - MIN_MS)], Tracking::Events);
    let p = patch_of(&d, "worker-1").expect("a patch");
    assert!(p.attached);
    assert_eq!(p.reason, GateReason::ConsumerAttached);
    assert_eq!(p.transition_ms, NOW);
    assert!(p.message.contains("ctag-1") && p.message.contains("10.0.0.1"), "{}", p.message);
    assert_eq!(p.event().unwrap().reason.as_str(), "GateOpened");
    let r = &d.report;
    assert_eq!((r.consumers.attached, r.consumers.expected), (1, 1));
    assert_eq!(r.consumers_attached.reason, Reason::Attached);
    assert_eq!(r.rollout.phase, RolloutPhase::Idle);
    assert_eq!(r.consumers.pods[0].gate, PodGate::Open, "written, and shown so before it is seen back");
}

#[test]
fn a_fresh_consumer_waits_out_min_attached_seconds_and_a_recheck_is_scheduled() {
    let d = run(&plan(), &[deployment(1)], &[pod(1)], &[consumer_from(1, NOW - 2_000)], Tracking::Events);
    assert!(no_flip(&d), "a new pod is held back, and says why: {:?}", d.patches);
    let r = &d.report;
    assert_eq!(r.recheck_after, Some(Duration::from_millis(3_000)));
    assert_eq!(r.consumers.attached, 0);
    assert_eq!(r.rollout.phase, RolloutPhase::WaitingForAttach);
    assert_eq!(r.rollout.waiting_pods[0].name, "worker-1");
    assert_eq!(r.rollout.waiting_pods[0].waiting_for, ["orders"]);
}

#[test]
fn no_consumer_keeps_the_gate_shut() {
    let d = run(&plan(), &[deployment(1)], &[pod(1)], &[], Tracking::Events);
    assert!(no_flip(&d));
    assert_eq!(d.report.consumers_attached.reason, Reason::TooFewAttached);
    assert_eq!(d.report.consumers.pods[0].gate, PodGate::Closed);
}

#[test]
fn nothing_changed_means_no_patch_and_no_event() {
    let d = run(
        &plan(),
        &[deployment(1)],
        &[open(pod(1), NOW - 60_000)],
        &[consumer_from(1, NOW - 60_000)],
        Tracking::Events,
    );
    assert!(d.patches.is_empty() && d.report.events.is_empty());
    // An open gate stays open when its consumer reconnects (a fresh attach time).
    let d =
        run(&plan(), &[deployment(1)], &[open(pod(1), NOW - 60_000)], &[consumer_from(1, NOW - 100)], Tracking::Events);
    assert!(d.patches.is_empty());
}

#[test]
fn a_detached_consumer_closes_the_gate_and_moves_the_transition_time() {
    let d = run(&plan(), &[deployment(1)], &[open(pod(1), NOW - 60_000)], &[], Tracking::Events);
    let p = patch_of(&d, "worker-1").unwrap();
    assert_eq!((p.attached, p.reason, p.transition_ms), (false, GateReason::WaitingForConsumer, NOW));
    assert_eq!(p.event().unwrap().reason.as_str(), "GateClosed");
}

#[test]
fn a_closed_gate_is_not_patched_again_while_it_stays_closed() {
    let mut waiting = pod(1);
    waiting.condition = Some(GateCondition {
        status: false,
        reason: GateReason::WaitingForConsumer.as_str().into(),
        since_ms: NOW - 9_000,
    });
    let d = run(&plan(), &[deployment(1)], &[waiting], &[consumer_from(1, NOW - 1_000)], Tracking::Events);
    assert!(d.patches.is_empty(), "NoConsumer to AttachedTooRecently is no flip");
    assert_eq!(d.report.rollout.waiting_pods[0].since.as_ref().unwrap().0.as_millisecond(), NOW - 1_000);
}

#[test]
fn patch_body_touches_only_the_gate_condition_and_guards_on_uid() {
    let d = run(&plan(), &[deployment(1)], &[pod(1)], &[consumer_from(1, 0)], Tracking::Events);
    let body = d.patches[0].body();
    assert_eq!(body["metadata"], json!({"uid": "uid-1"}));
    let conditions = body["status"]["conditions"].as_array().unwrap();
    assert_eq!(conditions.len(), 1);
    assert_eq!(conditions[0]["type"], GATE_CONDITION);
    assert_eq!(conditions[0]["status"], "True");
    assert_eq!(conditions[0]["reason"], "ConsumerAttached");
    assert_eq!(conditions[0]["lastTransitionTime"], "1970-01-01T00:16:40Z");
}

#[test]
fn failure_policy_closed_changes_nothing_it_cannot_see() {
    let unreachable = Tracking::Unavailable("connection refused".into());
    let mut stale = pod(1);
    stale.containers_ready_since_ms = Some(NOW - 3_600_000);
    let d = run(&plan(), &[deployment(2)], &[stale, open(pod(2), 0)], &[], unreachable);
    assert!(no_flip(&d) && patch_of(&d, "worker-2").is_none(), "{:?}", d.patches);
    assert_eq!(d.report.consumers_attached.status, crate::status::Truth::Unknown);
    assert_eq!(d.report.rollout.phase, RolloutPhase::Stalled);
    assert!(d.report.events.iter().any(|e| e.reason.as_str() == "RolloutStalled" && e.warning));
}

#[test]
fn a_stalled_rollout_is_announced_once() {
    let mut stale = pod(1);
    stale.containers_ready_since_ms = Some(NOW - 3_600_000);
    let key = ObjectKey::new("shop", "orders");
    let mut index = GateIndex::default();
    let facts = PolicyFacts {
        key: key.clone(),
        uid: "u".into(),
        selects: Selects::Named(Kind::Deployment, "worker".into()),
        plan: Ok(plan()),
        deleting: false,
    };
    index.replace_policies(vec![facts]);
    index.bind(&key, Ok(BoundQueue { source: 1, queue: queue(), dead_letter_queue: None }));
    index.replace_workloads(Kind::Deployment, vec![Workload::new(deployment(1))]);
    crate::testing::sync_workload_feeds(&mut index);
    index.replace_budgets(vec![]);
    index.replace_pods(vec![stale], NOW);
    let seen = Seen(vec![], Tracking::Events);
    let view = index.policy_view(&key, &seen, NOW).unwrap();
    assert!(report(&plan(), &view, Some(RolloutPhase::Stalled), NOW).events.is_empty());
    assert_eq!(report(&plan(), &view, Some(RolloutPhase::WaitingForAttach), NOW).events.len(), 1);
}

#[test]
fn failure_policy_open_opens_after_the_timeout_with_a_warning() {
    let mut p = plan();
    p.failure_policy = FailurePolicy::Open;
    let mut stale = pod(1);
    stale.containers_ready_since_ms = Some(NOW - 600_000);
    let young = pod(2);
    let d = run(&p, &[deployment(2)], &[stale.clone(), young], &[], Tracking::Unavailable("down".into()));
    let patch = patch_of(&d, "worker-1").unwrap();
    assert_eq!((patch.attached, patch.reason), (true, GateReason::BrokerUnreachable));
    let young = patch_of(&d, "worker-2").unwrap();
    assert_eq!((young.attached, young.reason), (false, GateReason::TrackingUnavailable), "its first word");
    let event = patch.event().unwrap();
    assert!(event.warning && event.reason.as_str() == "GateFailedOpen");
    assert_eq!(d.report.recheck_after, Some(Duration::from_millis(599_000)), "the young pod's timeout");
    // With the broker visible but no consumer coming, Open also gives up after the timeout.
    let d = run(&p, &[deployment(1)], &[stale], &[], Tracking::Events);
    assert_eq!(d.patches[0].reason, GateReason::AttachTimeoutExpired);
}

#[test]
fn observe_mode_reports_without_acting() {
    let mut p = plan();
    p.mode = GateMode::Observe;
    let mut recreate = deployment(1);
    recreate.spec.as_mut().unwrap().strategy =
        Some(DeploymentStrategy { type_: Some("Recreate".into()), rolling_update: None });
    let d = run(&p, &[recreate], &[pod(1)], &[consumer_from(1, 0)], Tracking::Events);
    assert!(d.writes.is_empty(), "{:?}", d.writes);
    assert_eq!(d.report.rollout_safe.reason, Reason::UnsafeRolloutStrategy);
    assert_eq!(d.patches.len(), 1, "the only guard is observing: nothing holds the pod, so its gate opens");
    assert_eq!(d.patches[0].reason, GateReason::NotGuarded);
    assert!(d.report.consumers.pods[0].attached, "and the policy still reports what it sees");
}

#[test]
fn unsafe_strategies_are_patched_when_managed_else_reported() {
    let mut recreate = deployment(3);
    recreate.spec.as_mut().unwrap().strategy =
        Some(DeploymentStrategy { type_: Some("Recreate".into()), rolling_update: None });
    let d = run(&plan(), std::slice::from_ref(&recreate), &[], &[], Tracking::Events);
    let r = &d.report;
    let fixes: Vec<_> = d.writes.iter().filter(|w| matches!(w, Write::Strategy(_))).collect();
    assert!(matches!(fixes.as_slice(), [Write::Strategy(f)] if f.workload.name == "worker"), "{fixes:?}");
    assert_eq!(r.rollout_safe.reason, Reason::RolloutGuarded);
    assert!(r.rollout_safe.message.contains("patched"));
    let mut p = plan();
    p.manage_strategy = false;
    let d = run(&p, &[recreate], &[], &[], Tracking::Events);
    assert!(!d.writes.iter().any(|w| matches!(w, Write::Strategy(_))));
    assert_eq!(d.report.rollout_safe.reason, Reason::UnsafeRolloutStrategy);
    assert!(d.report.rollout_safe.message.contains("manageStrategy"));
}

#[test]
fn pods_without_the_readiness_gate_are_listed() {
    let mut bare = pod(2);
    bare.has_gate = false;
    let d = run(&plan(), &[deployment(2)], &[pod(1), bare], &[consumer_from(2, 0)], Tracking::Events);
    assert_eq!(d.report.rollout_safe.reason, Reason::GateNotInstalled);
    assert!(d.report.rollout_safe.message.contains("worker-2"));
    assert!(d.report.rollout_safe.message.contains(crate::webhook::NAMESPACE_LABEL_TEXT));
    assert!(patch_of(&d, "worker-2").is_none(), "no condition on a pod that has no gate");
    let bare_status = d.report.consumers.pods.iter().find(|p| p.name == "worker-2").unwrap();
    assert_eq!((bare_status.gate, bare_status.attached), (PodGate::NotInstalled, true));
}

#[test]
fn a_missing_deployment_and_zero_replicas_are_reported() {
    let d = run(&plan(), &[], &[], &[], Tracking::Events);
    assert_eq!(d.report.rollout_safe.reason, Reason::WorkloadNotFound);
    assert!(d.report.rollout_safe.message.contains("'worker'"));
    let d = run(&plan(), &[deployment(0)], &[], &[], Tracking::Events);
    assert_eq!(d.report.consumers_attached.reason, Reason::ScaledToZero);
    assert!(d.report.rollout_safe.is_ok(), "nothing to gate at zero replicas");
}

#[test]
fn consumers_on_other_queues_and_nat_peers_do_not_count() {
    let mut elsewhere = consumer_from(1, 0);
    elsewhere.queue = QueueKey::new("/", "billing");
    let mut natted = consumer_from(1, 0);
    natted.peer_host = Some("192.168.99.1".into());
    let d = run(&plan(), &[deployment(1)], &[pod(1)], &[elsewhere, natted], Tracking::Events);
    assert!(no_flip(&d));
    assert_eq!(d.report.consumers.unmatched, 1, "the other queue's consumer is not even considered");
    assert!(
        d.report.consumers_attached.message.contains("matchBy: ConnectionName"),
        "{}",
        d.report.consumers_attached.message
    );
}

#[test]
fn terminating_pods_are_left_alone() {
    let mut leaving = open(pod(1), 0);
    leaving.deleting = true;
    let d = run(&plan(), &[deployment(1)], &[leaving, pod(2)], &[consumer_from(2, 0)], Tracking::Events);
    assert!(patch_of(&d, "worker-1").is_none());
    assert_eq!(d.report.consumers.pods.len(), 1);
}

#[test]
fn replicas_one_to_five_count_attached_pods_against_min_attached() {
    for replicas in 1..=5u8 {
        for attached in 0..=replicas {
            let pods: Vec<PodFacts> = (1..=replicas).map(pod).collect();
            let consumers: Vec<Consumer> = (1..=attached).map(|i| consumer_from(i, 0)).collect();
            let mut p = plan();
            p.min_attached = 2;
            let d = run(&p, &[deployment(i32::from(replicas))], &pods, &consumers, Tracking::Events);
            let r = &d.report;
            assert_eq!(r.consumers.attached, i32::from(attached));
            assert_eq!(r.consumers.expected, i32::from(replicas));
            assert_eq!(r.consumers_attached.is_ok(), attached >= 2, "replicas {replicas} attached {attached}");
            assert_eq!(d.patches.iter().filter(|p| p.attached).count(), usize::from(attached));
            let expected_phase = if attached < replicas { RolloutPhase::WaitingForAttach } else { RolloutPhase::Idle };
            assert_eq!(r.rollout.phase, expected_phase);
        }
    }
}

#[test]
fn a_deployment_mid_rollout_is_progressing() {
    let mut d = deployment(3);
    d.status.as_mut().unwrap().updated_replicas = Some(1);
    d.status.as_mut().unwrap().replicas = Some(4);
    let pods: Vec<PodFacts> = (1..=3).map(|i| open(pod(i), 0)).collect();
    let consumers: Vec<Consumer> = (1..=3).map(|i| consumer_from(i, 0)).collect();
    let outcome = run(&plan(), &[d], &pods, &consumers, Tracking::Events);
    assert_eq!(outcome.report.rollout.phase, RolloutPhase::Progressing);
}

#[test]
fn polling_is_said_in_status() {
    let d =
        run(&plan(), &[deployment(1)], &[pod(1)], &[consumer_from(1, 0)], Tracking::Polling("plugin missing".into()));
    assert_eq!(d.report.consumers.tracking, TrackingMode::Polling);
    assert!(d.report.consumers.tracking_reason.is_some());
    assert!(d.report.consumers_attached.message.contains("polling the management API (plugin missing)"));
    assert!(patch_of(&d, "worker-1").unwrap().attached, "polling data is live enough to gate on");
}

#[test]
fn a_pod_whose_consumer_left_waits_from_that_moment_not_from_its_start() {
    let mut veteran = open(pod(1), NOW - 86_400_000);
    veteran.containers_ready_since_ms = Some(NOW - 86_400_000);
    let d = run(&plan(), &[deployment(1)], &[veteran], &[], Tracking::Events);
    assert_eq!(d.patches.len(), 1, "closed now");
    let mut closed_long_ago = pod(2);
    closed_long_ago.containers_ready_since_ms = Some(NOW - 86_400_000);
    closed_long_ago.condition = Some(GateCondition {
        status: false,
        reason: GateReason::WaitingForConsumer.as_str().into(),
        since_ms: NOW - 700_000,
    });
    let d = run(&plan(), &[deployment(1)], &[closed_long_ago.clone()], &[], Tracking::Events);
    assert_eq!(d.report.rollout.phase, RolloutPhase::Stalled);
    closed_long_ago.condition.as_mut().unwrap().since_ms = NOW - 10_000;
    let d = run(&plan(), &[deployment(1)], &[closed_long_ago], &[], Tracking::Events);
    assert_eq!(d.report.rollout.phase, RolloutPhase::WaitingForAttach, "not Stalled: it started waiting 10 s ago");
    assert_eq!(d.report.rollout.waiting_pods[0].since.as_ref().unwrap().0.as_millisecond(), NOW - 10_000);
}
