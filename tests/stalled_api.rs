//! An API server that takes requests and never answers them (a dead keep-alive connection after
//! an API server failover): the one pod-condition writer moves on to the next pod at the
//! request's deadline, and a leader whose writer gets no answers gives its Lease up although the
//! Lease itself still renews.

mod common;

use common::{api::*, gate::*};
use http::StatusCode;
use queueguard::{
    controller::Context,
    leader::{HoldEnd, LeaderElector, LeaseConfig},
};
use serde_json::{Value, json};
use std::{
    sync::Arc,
    time::{Duration, Instant},
};

/// The deadline the tests' clients put on every request (the operator's is 15 s).
const DEADLINE: Duration = Duration::from_millis(300);

fn pod(n: u32) -> Value {
    let mut pod = worker_pod(None);
    pod["metadata"]["name"] = json!(format!("worker-abc-{n}"));
    pod["metadata"]["uid"] = json!(format!("pod-uid-{n}"));
    pod["status"]["podIP"] = json!(format!("10.0.0.{n}"));
    pod
}

/// Two pods carrying the gate that no QueuePolicy guards: the writer opens both.
fn two_unguarded_pods(ctx: &Context) {
    watched(ctx, &[], &[worker_deployment(json!({"type": "RollingUpdate"}))], &[pod(1), pod(2)], &[]);
}

fn status_patch_of(call: &Call) -> Option<String> {
    let pod = call.path.strip_prefix("/api/v1/namespaces/test/pods/")?.strip_suffix("/status")?;
    (call.method == "PATCH").then(|| pod.to_owned())
}

#[tokio::test]
async fn a_status_patch_that_is_never_answered_holds_the_next_pod_only_until_its_deadline() {
    let (client, mut api) = bounded_mock_client(DEADLINE);
    let ctx = Arc::new(Context::new(client, "stalled"));
    two_unguarded_pods(&ctx);

    let first = api.next(Duration::from_secs(5)).await.expect("the first pod's patch");
    let stuck = status_patch_of(&first).expect("a pod status patch");
    let sent = Instant::now();
    // `first` is kept and never answered. The other pod's patch comes once it is cut off.
    let second = api.next(Duration::from_secs(5)).await.expect("the writer moves on to the next pod");
    let waited = sent.elapsed();
    let other = status_patch_of(&second).expect("a pod status patch");
    assert_ne!(other, stuck, "the next pod, not a retry");
    eprintln!("the next pod's patch came {waited:?} after the unanswered one (deadline {DEADLINE:?})");
    assert!(waited >= DEADLINE - Duration::from_millis(20), "not before the deadline: {waited:?}");
    assert!(waited < DEADLINE * 4, "held only until the deadline: {waited:?}");
    assert!(ctx.gate.writer_unanswered().is_some(), "the writer counts the unanswered patch");
    second.respond(StatusCode::OK, &pod(2));

    // The stuck pod's patch is tried again (after the index's retry delay) and lands; the
    // answered pod's Event goes out beside it.
    let mut retried = false;
    let deadline = Instant::now() + Duration::from_secs(5);
    while !retried && Instant::now() < deadline {
        let Some(call) = api.next(Duration::from_secs(5)).await else { break };
        match status_patch_of(&call) {
            Some(p) => {
                assert_eq!(p, stuck, "only the unanswered pod is written again");
                retried = true;
                call.respond(StatusCode::OK, &pod(1));
            }
            None => {
                assert_eq!(call.path, "/apis/events.k8s.io/v1/namespaces/test/events");
                let body = call.body.clone();
                call.respond(StatusCode::CREATED, &body);
            }
        }
    }
    assert!(retried, "the unanswered patch is tried again");
    assert!(
        common::eventually(Duration::from_secs(2), || async { ctx.gate.writer_unanswered().is_none() }).await,
        "answered: the writer is no longer waiting"
    );
    drop(first);
}

#[tokio::test]
async fn a_leader_whose_writer_gets_no_answer_gives_up_the_lease_that_still_renews() {
    let (client, mut pods_api) = bounded_mock_client(DEADLINE);
    let ctx = Arc::new(Context::new(client, "stalled-leader"));
    let (lease_client, mut lease_api) = bounded_mock_client(DEADLINE);
    let mut cfg = LeaseConfig::new("queueguard".into(), "ops".into(), "pod-a".into());
    cfg.duration = Duration::from_millis(1_500);
    cfg.renew_deadline = Duration::from_secs(1);
    cfg.retry_period = Duration::from_millis(100);
    let elector = LeaderElector::new(lease_client, cfg);

    // The Lease answers every renewal.
    let renewals = tokio::spawn(async move {
        let mut renewed = 0;
        while let Some(call) = lease_api.next(Duration::from_secs(10)).await {
            let lease = json!({
                "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": "queueguard", "namespace": "ops", "resourceVersion": "7"},
                "spec": {"holderIdentity": "pod-a", "leaseDurationSeconds": 2,
                         "renewTime": k8s_openapi::jiff::Timestamp::now().to_string()},
            });
            match call.method.as_str() {
                "GET" => call.respond(StatusCode::OK, &lease),
                "PUT" => {
                    renewed += 1;
                    let body = call.body.clone();
                    call.respond(StatusCode::OK, &body);
                }
                other => panic!("unexpected {other} {}", call.path),
            }
        }
        renewed
    });
    // Every pod status patch is taken and never answered.
    let stalled = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Some(call) = pods_api.next(Duration::from_secs(10)).await {
            assert!(status_patch_of(&call).is_some(), "only pod status patches: {}", call.path);
            held.push(call);
        }
        held.len()
    });

    let stall = DEADLINE * 3;
    let started = Instant::now();
    let gate = ctx.gate.clone();
    let hold = tokio::spawn(async move {
        elector.hold(tokio::time::Instant::now(), || gate.writer_unanswered().is_some_and(|d| d >= stall)).await
    });
    two_unguarded_pods(&ctx);
    let end = tokio::time::timeout(Duration::from_secs(5), hold).await.expect("gives the Lease up").unwrap();
    let held_for = started.elapsed();
    eprintln!("gave the Lease up after {held_for:?} (writer stall {stall:?})");
    assert_eq!(end, HoldEnd::Unfit, "given up for the writer, not lost");
    assert!(held_for >= stall, "not before the writer stalled that long: {held_for:?}");
    assert!(held_for < stall + Duration::from_secs(1), "soon after: {held_for:?}");
    drop(ctx);
    let renewed = renewals.await.unwrap();
    assert!(renewed >= 2, "the Lease kept renewing while the writer was stuck ({renewed} renewals)");
    assert!(stalled.await.unwrap() >= 2, "the writer kept trying");
}
