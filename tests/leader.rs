//! Leader election against a mocked API server that checks each request: who creates, renews,
//! takes over and releases the Lease, and with which resourceVersion.

mod common;

use common::api::*;
use http::StatusCode;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use queueguard::leader::{HoldEnd, LeaderElector, LeaseConfig};
use serde_json::{Value, json};
use std::time::Duration;

const LEASE: &str = "/apis/coordination.k8s.io/v1/namespaces/ops/leases/queueguard";
const LEASES: &str = "/apis/coordination.k8s.io/v1/namespaces/ops/leases";

fn elector() -> (LeaderElector, ApiServer) {
    let (client, api) = mock_client();
    let mut cfg = LeaseConfig::new("queueguard".into(), "ops".into(), "pod-a".into());
    cfg.retry_period = Duration::from_millis(20);
    (LeaderElector::new(client, cfg), api)
}

/// A Lease of 1.5 s, renewed every 0.1 s, given up after 1 s without renewal.
fn short_elector() -> (LeaderElector, ApiServer) {
    let (client, api) = mock_client();
    let mut cfg = LeaseConfig::new("queueguard".into(), "ops".into(), "pod-a".into());
    cfg.duration = Duration::from_millis(1_500);
    cfg.renew_deadline = Duration::from_secs(1);
    cfg.retry_period = Duration::from_millis(100);
    (LeaderElector::new(client, cfg), api)
}

fn lease(holder: &str, renewed_secs_ago: i64, version: &str) -> Value {
    let renewed = Timestamp::now() - SignedDuration::from_secs(renewed_secs_ago);
    json!({
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": "queueguard", "namespace": "ops", "resourceVersion": version},
        "spec": {
            "holderIdentity": holder, "leaseDurationSeconds": 15, "leaseTransitions": 2,
            "acquireTime": renewed.to_string(), "renewTime": renewed.to_string(),
        }
    })
}

fn not_found() -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404, "message": "not found"})
}

fn conflict() -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Conflict", "code": 409, "message": "the object has been modified"})
}

#[tokio::test]
async fn the_first_replica_creates_the_lease_holding_it() {
    let (elector, mut api) = elector();
    let attempt = tokio::spawn(async move { elector.try_once().await.unwrap() });
    api.expect("GET", LEASE).await.respond(StatusCode::NOT_FOUND, &not_found());
    let create = api.expect("POST", LEASES).await;
    let spec = create.body["spec"].clone();
    assert_eq!(spec["holderIdentity"], "pod-a");
    assert_eq!(spec["leaseDurationSeconds"], 15);
    assert_eq!(spec["leaseTransitions"], 0);
    assert!(spec["renewTime"].is_string() && spec["acquireTime"].is_string());
    let body = create.body.clone();
    create.respond(StatusCode::CREATED, &body);
    assert!(attempt.await.unwrap(), "the creator leads");
}

#[tokio::test]
async fn a_lease_renewed_in_time_by_another_replica_is_left_alone() {
    let (elector, mut api) = elector();
    let attempt = tokio::spawn(async move { elector.try_once().await.unwrap() });
    api.expect("GET", LEASE).await.respond(StatusCode::OK, &lease("pod-b", 3, "41"));
    assert!(!attempt.await.unwrap(), "pod-b still leads");
    let extra = tokio::time::timeout(Duration::from_millis(200), api.0.next_request()).await;
    assert!(!matches!(extra, Ok(Some(_))), "a standby writes nothing");
}

#[tokio::test]
async fn an_expired_lease_is_taken_over_with_the_version_read_and_a_lost_race_is_no_win() {
    let (elector, mut api) = elector();
    let elector = std::sync::Arc::new(elector);
    let e = elector.clone();
    let attempt = tokio::spawn(async move { e.try_once().await.unwrap() });
    api.expect("GET", LEASE).await.respond(StatusCode::OK, &lease("pod-b", 60, "41"));
    let put = api.expect("PUT", LEASE).await;
    assert_eq!(put.body["metadata"]["resourceVersion"], "41", "the write is conditional on what was read");
    assert_eq!(put.body["spec"]["holderIdentity"], "pod-a");
    assert_eq!(put.body["spec"]["leaseTransitions"], 3);
    let body = put.body.clone();
    put.respond(StatusCode::OK, &body);
    assert!(attempt.await.unwrap());

    let e = elector.clone();
    let race = tokio::spawn(async move { e.try_once().await.unwrap() });
    api.expect("GET", LEASE).await.respond(StatusCode::OK, &lease("pod-b", 60, "42"));
    api.expect("PUT", LEASE).await.respond(StatusCode::CONFLICT, &conflict());
    assert!(!race.await.unwrap(), "another replica wrote first: it leads, not us");
}

#[tokio::test]
async fn the_leader_steps_down_when_another_replica_holds_the_lease() {
    let (elector, mut api) = elector();
    let hold = tokio::spawn(async move { elector.hold(tokio::time::Instant::now(), || false).await });
    api.expect("GET", LEASE).await.respond(StatusCode::OK, &lease("pod-a", 1, "50"));
    let renew = api.expect("PUT", LEASE).await;
    assert_eq!(renew.body["spec"]["holderIdentity"], "pod-a");
    let body = renew.body.clone();
    renew.respond(StatusCode::OK, &body);
    assert!(!hold.is_finished(), "renewed: still leading");
    api.expect("GET", LEASE).await.respond(StatusCode::OK, &lease("pod-b", 0, "51"));
    let end = tokio::time::timeout(Duration::from_secs(5), hold).await.expect("hold returns").unwrap();
    assert_eq!(end, HoldEnd::Lost);
}

#[tokio::test]
async fn release_on_shutdown_hands_the_lease_over_at_once() {
    let (elector, mut api) = elector();
    let release = tokio::spawn(async move { elector.release().await.unwrap() });
    api.expect("GET", LEASE).await.respond(StatusCode::OK, &lease("pod-a", 1, "60"));
    let put = api.expect("PUT", LEASE).await;
    assert!(put.body["spec"].get("holderIdentity").is_none_or(Value::is_null), "{}", put.body);
    assert_eq!(put.body["spec"]["leaseDurationSeconds"], 1);
    assert_eq!(put.body["metadata"]["resourceVersion"], "60");
    let body = put.body.clone();
    put.respond(StatusCode::OK, &body);
    release.await.unwrap();

    let (elector, mut api) = self::elector();
    let release = tokio::spawn(async move { elector.release().await.unwrap() });
    api.expect("GET", LEASE).await.respond(StatusCode::OK, &lease("pod-b", 1, "61"));
    release.await.unwrap();
    let extra = tokio::time::timeout(Duration::from_millis(200), api.0.next_request()).await;
    assert!(!matches!(extra, Ok(Some(_))), "a lease held by someone else is not touched");
}

#[tokio::test]
async fn a_leader_whose_api_server_stops_answering_steps_down_by_the_renew_deadline() {
    let (elector, mut api) = short_elector();
    let since = tokio::time::Instant::now();
    let hold = tokio::spawn(async move { elector.hold(since, || false).await });
    // One renewal answered, then the API server takes the next request and never answers.
    api.expect("GET", LEASE).await.respond(StatusCode::OK, &lease("pod-a", 0, "70"));
    let renew = api.expect("PUT", LEASE).await;
    let body = renew.body.clone();
    let renewed = std::time::Instant::now();
    renew.respond(StatusCode::OK, &body);
    let _hung = api.expect("GET", LEASE).await;
    let end = tokio::time::timeout(Duration::from_secs(3), hold).await.expect("hold returns though the request hangs");
    assert_eq!(end.unwrap(), HoldEnd::Lost);
    let stepped_down = renewed.elapsed();
    eprintln!("stepped down {stepped_down:?} after the last renewal (renew deadline 1 s, Lease 1.5 s)");
    assert!(stepped_down < Duration::from_millis(1_500), "before the Lease expired: {stepped_down:?}");
    assert!(stepped_down >= Duration::from_millis(900), "not before the renew deadline: {stepped_down:?}");
}

#[tokio::test]
async fn a_candidate_whose_api_server_hangs_retries() {
    let (elector, mut api) = short_elector();
    let acquire = tokio::spawn(async move { elector.acquire().await });
    let _hung = api.expect("GET", LEASE).await;
    // Cut off at the renew deadline, the candidate asks again.
    let again = tokio::time::timeout(Duration::from_secs(3), api.expect("GET", LEASE)).await.expect("a retry");
    again.respond(StatusCode::NOT_FOUND, &not_found());
    let create = api.expect("POST", LEASES).await;
    let body = create.body.clone();
    create.respond(StatusCode::CREATED, &body);
    tokio::time::timeout(Duration::from_secs(1), acquire).await.expect("leads").unwrap();
}
