//! Table tests of the gate's decisions: no cluster, no broker, only observed state in and
//! decisions out.

use super::{pods::GateCondition, *};
use crate::crd::{ConsumersSpec, FailurePolicy, GateMode, MatchBy};
use k8s_openapi::api::apps::v1::{DeploymentSpec, DeploymentStatus, DeploymentStrategy};

const NOW: i64 = 1_000_000;
const MIN_MS: i64 = 5_000;

fn plan() -> GatePlan {
    GatePlan {
        mode: GateMode::Enforce,
        failure_policy: FailurePolicy::Closed,
        attach_timeout: Duration::from_secs(600),
        manage_strategy: true,
        pod_disruption_budget: true,
        min_attached: 1,
        min_attached_for: Duration::from_millis(MIN_MS as u64),
        match_by: MatchBy::PodIp,
        consumers: ConsumersSpec {
            deployment: Some("worker".into()),
            selector: None,
            min_attached: 1,
            min_attached_seconds: 5,
            match_by: MatchBy::PodIp,
        },
    }
}

fn deployment(replicas: i32) -> Deployment {
    Deployment {
        metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
            name: Some("worker".into()),
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
    PodFacts {
        name: format!("worker-{i}"),
        uid: format!("uid-{i}"),
        ips: vec![format!("10.0.0.{i}")],
        has_gate: true,
        condition: None,
        containers_ready_since_ms: Some(NOW - 1_000),
        deleting: false,
    }
}

fn open(mut p: PodFacts, since_ms: i64) -> PodFacts {
    p.condition = Some(GateCondition { status: true, reason: reason::ATTACHED.into(), since_ms });
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
    }
}

fn run(
    plan: &GatePlan,
    deployments: &[Deployment],
    pods: &[PodFacts],
    consumers: &[Consumer],
    tracking: Tracking,
) -> Decision {
    decide(plan, &Observed { queue: &queue(), deployments, pods, consumers, tracking: &tracking, now_ms: NOW })
}

fn patch_of<'a>(d: &'a Decision, pod: &str) -> Option<&'a PodPatch> {
    d.pod_patches.iter().find(|p| p.pod == pod)
}

#[test]
fn a_consumer_attached_long_enough_opens_the_gate() {
    let d = run(&plan(), &[deployment(1)], &[pod(1)], &[consumer_from(1, NOW - MIN_MS)], Tracking::Events);
    let p = patch_of(&d, "worker-1").expect("a patch");
    assert!(p.attached);
    assert_eq!(p.reason, reason::ATTACHED);
    assert_eq!(p.transition_ms, NOW);
    assert!(p.message.contains("ctag-1") && p.message.contains("10.0.0.1"), "{}", p.message);
    assert_eq!(d.events[0].reason, "GateOpened");
    assert_eq!((d.consumers.attached, d.consumers.expected), (1, 1));
    assert_eq!(d.consumers_attached.reason, Reason::Attached);
    assert_eq!(d.rollout.phase, "Idle");
    assert_eq!(d.consumers.pods[0].gate, "Open");
}

#[test]
fn a_fresh_consumer_waits_out_min_attached_seconds_and_a_recheck_is_scheduled() {
    let d = run(&plan(), &[deployment(1)], &[pod(1)], &[consumer_from(1, NOW - 2_000)], Tracking::Events);
    let p = patch_of(&d, "worker-1").unwrap();
    assert_eq!((p.attached, p.reason), (false, reason::TOO_RECENT));
    assert_eq!(d.recheck_after, Some(Duration::from_millis(3_000)));
    assert_eq!(d.consumers.attached, 0);
    assert_eq!(d.rollout.phase, "WaitingForAttach");
    assert_eq!(d.rollout.waiting_pods[0].name, "worker-1");
}

#[test]
fn no_consumer_keeps_the_gate_shut() {
    let d = run(&plan(), &[deployment(1)], &[pod(1)], &[], Tracking::Events);
    let p = patch_of(&d, "worker-1").unwrap();
    assert_eq!((p.attached, p.reason), (false, reason::NO_CONSUMER));
    assert_eq!(d.consumers_attached.reason, Reason::TooFewAttached);
    assert_eq!(d.events[0].reason, "GateClosed");
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
    assert!(d.pod_patches.is_empty() && d.events.is_empty(), "{d:?}");
    // An open gate stays open when its consumer reconnects (a fresh attach time).
    let d =
        run(&plan(), &[deployment(1)], &[open(pod(1), NOW - 60_000)], &[consumer_from(1, NOW - 100)], Tracking::Events);
    assert!(d.pod_patches.is_empty());
}

#[test]
fn a_detached_consumer_closes_the_gate_and_moves_the_transition_time() {
    let d = run(&plan(), &[deployment(1)], &[open(pod(1), NOW - 60_000)], &[], Tracking::Events);
    let p = patch_of(&d, "worker-1").unwrap();
    assert_eq!((p.attached, p.reason, p.transition_ms), (false, reason::NO_CONSUMER, NOW));
}

#[test]
fn a_reason_change_within_the_same_status_keeps_the_transition_time() {
    let mut waiting = pod(1);
    waiting.condition =
        Some(GateCondition { status: false, reason: reason::NO_CONSUMER.into(), since_ms: NOW - 9_000 });
    let d = run(&plan(), &[deployment(1)], &[waiting], &[consumer_from(1, NOW - 1_000)], Tracking::Events);
    let p = patch_of(&d, "worker-1").unwrap();
    assert_eq!((p.reason, p.transition_ms), (reason::TOO_RECENT, NOW - 9_000));
}

#[test]
fn patch_body_touches_only_the_gate_condition_and_guards_on_uid() {
    let d = run(&plan(), &[deployment(1)], &[pod(1)], &[consumer_from(1, 0)], Tracking::Events);
    let body = d.pod_patches[0].body();
    assert_eq!(body["metadata"], json!({"uid": "uid-1"}));
    let conditions = body["status"]["conditions"].as_array().unwrap();
    assert_eq!(conditions.len(), 1);
    assert_eq!(conditions[0]["type"], GATE_CONDITION);
    assert_eq!(conditions[0]["status"], "True");
    assert_eq!(conditions[0]["lastTransitionTime"], "1970-01-01T00:16:40Z");
}

#[test]
fn failure_policy_closed_changes_nothing_it_cannot_see() {
    let unreachable = Tracking::Unavailable("connection refused".into());
    let mut stale = pod(1);
    stale.containers_ready_since_ms = Some(NOW - 3_600_000);
    let d = run(&plan(), &[deployment(2)], &[stale, open(pod(2), 0)], &[], unreachable);
    assert!(d.pod_patches.is_empty(), "{:?}", d.pod_patches);
    assert_eq!(d.consumers_attached.status, crate::status::Truth::Unknown);
    assert_eq!(d.rollout.phase, "Stalled");
    assert!(d.events.iter().any(|e| e.reason == "RolloutStalled" && e.warning));
}

#[test]
fn failure_policy_open_opens_after_the_timeout_with_a_warning() {
    let mut p = plan();
    p.failure_policy = FailurePolicy::Open;
    let mut stale = pod(1);
    stale.containers_ready_since_ms = Some(NOW - 600_000);
    let young = pod(2);
    let d = run(&p, &[deployment(2)], &[stale.clone(), young], &[], Tracking::Unavailable("down".into()));
    assert_eq!(d.pod_patches.len(), 1);
    let patch = &d.pod_patches[0];
    assert_eq!((patch.pod.as_str(), patch.attached, patch.reason), ("worker-1", true, reason::UNREACHABLE_OPEN));
    assert!(d.events.iter().any(|e| e.reason == "GateFailedOpen" && e.warning));
    assert_eq!(d.recheck_after, Some(Duration::from_millis(599_000)), "the young pod's timeout");
    // With the broker visible but no consumer coming, Open also gives up after the timeout.
    let d = run(&p, &[deployment(1)], &[stale], &[], Tracking::Events);
    assert_eq!(d.pod_patches[0].reason, reason::TIMEOUT_OPEN);
}

#[test]
fn observe_mode_reports_without_acting() {
    let mut p = plan();
    p.mode = GateMode::Observe;
    let mut recreate = deployment(1);
    recreate.spec.as_mut().unwrap().strategy =
        Some(DeploymentStrategy { type_: Some("Recreate".into()), rolling_update: None });
    let d = run(&p, &[recreate], &[pod(1)], &[consumer_from(1, 0)], Tracking::Events);
    assert!(d.strategy_patches.is_empty());
    assert_eq!(d.rollout_safe.reason, Reason::UnsafeRolloutStrategy);
    assert!(d.events.iter().all(|e| e.note.contains("not applied")), "{:?}", d.events);
}

#[test]
fn unsafe_strategies_are_patched_when_managed_else_reported() {
    let mut recreate = deployment(3);
    recreate.spec.as_mut().unwrap().strategy =
        Some(DeploymentStrategy { type_: Some("Recreate".into()), rolling_update: None });
    let d = run(&plan(), std::slice::from_ref(&recreate), &[], &[], Tracking::Events);
    assert_eq!(d.strategy_patches.len(), 1);
    assert_eq!(d.strategy_patches[0].0, "worker");
    assert_eq!(d.rollout_safe.reason, Reason::RolloutGuarded);
    assert!(d.rollout_safe.message.contains("patched"));
    assert!(d.events.iter().any(|e| e.reason == "StrategyPatched"));
    let mut p = plan();
    p.manage_strategy = false;
    let d = run(&p, &[recreate], &[], &[], Tracking::Events);
    assert!(d.strategy_patches.is_empty());
    assert_eq!(d.rollout_safe.reason, Reason::UnsafeRolloutStrategy);
    assert!(d.rollout_safe.message.contains("manageStrategy"));
}

#[test]
fn pods_without_the_readiness_gate_are_listed() {
    let mut bare = pod(2);
    bare.has_gate = false;
    let d = run(&plan(), &[deployment(2)], &[pod(1), bare], &[consumer_from(2, 0)], Tracking::Events);
    assert_eq!(d.rollout_safe.reason, Reason::GateNotInstalled);
    assert!(d.rollout_safe.message.contains("worker-2"));
    assert!(patch_of(&d, "worker-2").is_none(), "no condition on a pod that has no gate");
    let bare_status = d.consumers.pods.iter().find(|p| p.name == "worker-2").unwrap();
    assert_eq!((bare_status.gate.as_str(), bare_status.attached), ("NotInstalled", true));
}

#[test]
fn a_missing_deployment_and_zero_replicas_are_reported() {
    let d = run(&plan(), &[], &[], &[], Tracking::Events);
    assert_eq!(d.rollout_safe.reason, Reason::DeploymentNotFound);
    assert!(d.rollout_safe.message.contains("'worker'"));
    let d = run(&plan(), &[deployment(0)], &[], &[], Tracking::Events);
    assert_eq!(d.consumers_attached.reason, Reason::ScaledToZero);
    assert!(d.rollout_safe.is_ok(), "nothing to gate at zero replicas");
}

#[test]
fn consumers_on_other_queues_and_nat_peers_do_not_count() {
    let mut elsewhere = consumer_from(1, 0);
    elsewhere.queue = QueueKey::new("/", "billing");
    let mut natted = consumer_from(1, 0);
    natted.peer_host = Some("192.168.99.1".into());
    let d = run(&plan(), &[deployment(1)], &[pod(1)], &[elsewhere, natted], Tracking::Events);
    assert_eq!(patch_of(&d, "worker-1").unwrap().reason, reason::NO_CONSUMER);
    assert_eq!(d.consumers.unmatched, 1, "the other queue's consumer is not even considered");
    assert!(d.consumers_attached.message.contains("matchBy: ConnectionName"), "{}", d.consumers_attached.message);
}

#[test]
fn terminating_pods_are_left_alone() {
    let mut leaving = open(pod(1), 0);
    leaving.deleting = true;
    let d = run(&plan(), &[deployment(1)], &[leaving, pod(2)], &[consumer_from(2, 0)], Tracking::Events);
    assert!(patch_of(&d, "worker-1").is_none());
    assert_eq!(d.consumers.pods.len(), 1);
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
            assert_eq!(d.consumers.attached, i32::from(attached));
            assert_eq!(d.consumers.expected, i32::from(replicas));
            assert_eq!(d.consumers_attached.is_ok(), attached >= 2, "replicas {replicas} attached {attached}");
            assert_eq!(d.pod_patches.iter().filter(|p| p.attached).count(), usize::from(attached));
            let expected_phase = if attached < replicas { "WaitingForAttach" } else { "Idle" };
            assert_eq!(d.rollout.phase, expected_phase);
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
    let decision = run(&plan(), &[d], &pods, &consumers, Tracking::Events);
    assert_eq!(decision.rollout.phase, "Progressing");
}

#[test]
fn polling_is_said_in_status() {
    let d =
        run(&plan(), &[deployment(1)], &[pod(1)], &[consumer_from(1, 0)], Tracking::Polling("plugin missing".into()));
    assert!(d.consumers.tracking.starts_with("Polling"));
    assert!(d.consumers_attached.message.contains("polling the management API (plugin missing)"));
    assert!(patch_of(&d, "worker-1").unwrap().attached, "polling data is live enough to gate on");
}

#[test]
fn a_pod_whose_consumer_left_waits_from_that_moment_not_from_its_start() {
    let mut veteran = open(pod(1), NOW - 86_400_000);
    veteran.containers_ready_since_ms = Some(NOW - 86_400_000);
    let d = run(&plan(), &[deployment(1)], &[veteran], &[], Tracking::Events);
    assert_eq!(d.rollout.phase, "WaitingForAttach", "not Stalled: it started waiting just now");
    assert_eq!(d.rollout.waiting_pods[0].since.as_ref().unwrap().0.as_millisecond(), NOW);
    let mut closed_long_ago = pod(2);
    closed_long_ago.containers_ready_since_ms = Some(NOW - 86_400_000);
    closed_long_ago.condition =
        Some(GateCondition { status: false, reason: reason::NO_CONSUMER.into(), since_ms: NOW - 700_000 });
    let d = run(&plan(), &[deployment(1)], &[closed_long_ago], &[], Tracking::Events);
    assert_eq!(d.rollout.phase, "Stalled");
}
