//! The proof: rolling restarts of a simulated consumer Deployment (the Deployment controller's
//! RollingUpdate rules, real consumers on the real broker, a publisher sending numbered messages
//! throughout, random boot and attach delays) with the operator's own tracker and gate deciding
//! each pod's readiness. The same run without queueguard, on an auto-delete queue, must show the
//! loss, or the test could not see one.

mod common;

use common::*;
use queueguard::{
    broker::uri::BrokerUri,
    simulation::{self, Scenario},
    workload::Kind,
};

fn uri() -> BrokerUri {
    BrokerUri::parse(&broker_uri(), Some(&management_base())).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_guarded_rolling_restarts_lose_nothing_and_never_delete_the_queue() {
    let report = simulation::run(&Scenario::new(true, 2, 10), &uri()).await.unwrap();
    eprintln!("{}", simulation::table(std::slice::from_ref(&report)));
    assert_eq!(report.restarts, 10);
    assert!(report.published > 500, "the publisher ran throughout: {report:?}");
    assert_eq!(report.lost, 0, "every published message is consumed at least once: {report:?}");
    assert_eq!(report.consumed, report.published);
    assert_eq!(report.queue_deletions, 0, "{report:?}");
    assert_eq!(report.premature_opens, 0, "no gate opened before its consumer attached: {report:?}");
    assert!(report.longest_gate_wait.is_some());
    assert!(report.fewest_consumers[0] >= 1, "{report:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_restarts_on_an_auto_delete_queue_without_the_gate_lose_messages() {
    let report = simulation::run(&Scenario::new(false, 2, 10), &uri()).await.unwrap();
    eprintln!("{}", simulation::table(std::slice::from_ref(&report)));
    assert!(report.queue_deletions > 0, "the last consumer leaving deletes the queue: {report:?}");
    assert!(report.lost > 0, "and the messages with it: {report:?}");
    assert_eq!(report.longest_gate_wait, None);
}

/// A worker reading two queues, each guarded by its own QueuePolicy: its pods turn Ready only
/// once they read both, so both queues keep a consumer through every restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_with_two_guarded_queues_keeps_a_consumer_on_each_through_every_restart() {
    let scenario = Scenario { queues: 2, ..Scenario::new(true, 2, 6) };
    let report = simulation::run(&scenario, &uri()).await.unwrap();
    eprintln!("{}", simulation::table(std::slice::from_ref(&report)));
    assert_eq!(report.fewest_consumers.len(), 2);
    assert!(report.fewest_consumers.iter().all(|n| *n >= 1), "a moment with a queue unread: {report:?}");
    assert_eq!((report.lost, report.queue_deletions, report.premature_opens), (0, 0, 0), "{report:?}");
    let naive = simulation::run(&Scenario { queues: 2, ..Scenario::new(false, 2, 6) }, &uri()).await.unwrap();
    assert!(naive.fewest_consumers.contains(&0), "without the gate a queue goes unread: {naive:?}");
}

/// A StatefulSet replaces one pod at a time without surge; with two replicas the gate holds
/// each next step until the recreated pod's consumer attached, so the queue always has one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guarded_statefulset_restarts_keep_a_consumer_and_lose_nothing() {
    let scenario = Scenario { workload: Kind::StatefulSet, ..Scenario::new(true, 2, 4) };
    let report = simulation::run(&scenario, &uri()).await.unwrap();
    eprintln!("{}", simulation::table(std::slice::from_ref(&report)));
    assert_eq!((report.lost, report.queue_deletions, report.premature_opens), (0, 0, 0), "{report:?}");
    assert!(report.fewest_consumers[0] >= 1, "{report:?}");
    assert_eq!(report.unsafe_strategy, None);
}

/// With one replica no strategy can keep a consumer while the pod restarts: the gate says so
/// (RolloutSafe=False) and the queue, durable, keeps every message through the gap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_replica_statefulset_shows_the_gap_it_reports_and_still_loses_nothing() {
    let scenario = Scenario { workload: Kind::StatefulSet, ..Scenario::new(true, 1, 3) };
    let report = simulation::run(&scenario, &uri()).await.unwrap();
    eprintln!("{}", simulation::table(std::slice::from_ref(&report)));
    let why = report.unsafe_strategy.as_deref().expect("reported as unsafe");
    assert!(why.contains("without surge") && why.contains("run at least 2 replicas"), "{why}");
    assert_eq!(report.fewest_consumers, [0], "a moment without a consumer: {report:?}");
    assert_eq!((report.lost, report.queue_deletions), (0, 0), "{report:?}");
}

/// An Argo canary Rollout (no steps, no traffic routing) scales its ReplicaSets as a Deployment
/// does; its pods reach the gate through their ReplicaSet's owner.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guarded_canary_rollouts_lose_nothing() {
    let scenario = Scenario { workload: Kind::Rollout, ..Scenario::new(true, 2, 4) };
    let report = simulation::run(&scenario, &uri()).await.unwrap();
    eprintln!("{}", simulation::table(std::slice::from_ref(&report)));
    assert_eq!((report.lost, report.queue_deletions, report.premature_opens), (0, 0, 0), "{report:?}");
    assert!(report.fewest_consumers[0] >= 1 && report.longest_gate_wait.is_some(), "{report:?}");
}

/// The queue changes type (classic to quorum) under a guarded worker Deployment, then the
/// operator's restart rolls the workload through the gate, then two more restarts: the worker
/// keeps consuming throughout, and nothing published through the bound exchange is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_changed_live_under_a_guarded_deployment_loses_nothing() {
    let scenario = Scenario { migrate: true, ..Scenario::new(true, 2, 3) };
    let report = simulation::run(&scenario, &uri()).await.unwrap();
    eprintln!("{}", simulation::table(std::slice::from_ref(&report)));
    let migration = report.migration.as_ref().expect("the queue was migrated");
    eprintln!("{}", migration.line());
    assert!(migration.from.starts_with("classic") && migration.to.starts_with("quorum"), "{migration:?}");
    assert_eq!(migration.queue_deletions, 1, "the swap deleted the old queue once: {migration:?}");
    assert!(migration.swap_window_ms > 0 && migration.fenced_ms >= migration.swap_window_ms, "{migration:?}");
    assert_eq!(report.restarts, 3, "the operator's restart and two more");
    assert!(report.published > 200, "the publisher ran throughout: {report:?}");
    assert_eq!((report.lost, report.consumed), (0, report.published), "{report:?}");
    assert_eq!((report.queue_deletions, report.premature_opens), (0, 0), "{report:?}");
}

#[test]
fn the_demo_migrate_command_prints_the_swap_and_exits_0() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_queueguard"))
        .args(["demo", "--migrate", "--restarts", "1"])
        .env("QUEUEGUARD_BROKER_URI", broker_uri())
        .env("QUEUEGUARD_MANAGEMENT_URI", management_base())
        .output()
        .unwrap();
    let stdout = String::from_utf8(out.stdout).unwrap();
    let log = String::from_utf8(out.stderr).unwrap();
    assert_eq!(out.status.code(), Some(0), "{stdout}{log}");
    let lines: Vec<&str> = stdout.lines().collect();
    assert!(lines[1].starts_with("guarded, queue type changed live"), "{stdout}");
    let lost: u64 = lines[1].split_whitespace().rev().nth(4).unwrap().parse().unwrap();
    assert_eq!(lost, 0, "{stdout}");
    assert!(lines[2].starts_with("queue type changed live: classic -> quorum") && lines[2].contains("swap window"));
    // Each step of both queues (dead-letter queue first) is told before it is taken.
    let steps: Vec<&str> =
        log.lines().filter(|l| l.starts_with("queue '")).filter_map(|l| l.split(": ").nth(1)).collect();
    let once = ["Preparing", "Draining", "Swapping", "Restoring", "Refilling", "RestartingConsumers"];
    assert_eq!(steps, [&once[..], &once[..]].concat(), "{log}");
    assert!(!log.contains("ERROR") && !log.contains("WARN"), "{log}");
}

#[test]
fn the_demo_command_prints_both_scenarios_and_exits_0() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_queueguard"))
        .args(["demo", "--restarts", "2"])
        .env("QUEUEGUARD_BROKER_URI", broker_uri())
        .env("QUEUEGUARD_MANAGEMENT_URI", management_base())
        .output()
        .unwrap();
    let table = String::from_utf8(out.stdout).unwrap();
    assert_eq!(out.status.code(), Some(0), "{table}{}", String::from_utf8_lossy(&out.stderr));
    let lines: Vec<&str> = table.lines().collect();
    assert!(lines[0].starts_with("scenario") && lines[0].contains("lost") && lines[0].contains("longest gate wait"));
    assert!(lines[1].starts_with("guarded") && lines[2].starts_with("auto-delete"), "{table}");
    let lost: Vec<u64> =
        lines[1..].iter().map(|l| l.split_whitespace().rev().nth(4).unwrap().parse().unwrap()).collect();
    assert_eq!(lost[0], 0, "{table}");
    // What a new user sees with output sent to a file: the progress lines, no errors from the
    // closes the simulation makes on purpose, and no colour codes.
    let log = String::from_utf8(out.stderr).unwrap();
    assert!(!log.contains("ERROR") && !log.contains("WARN"), "{log}");
    assert!(!log.contains('\u{1b}'), "colour codes in a log that is not a terminal: {log:?}");
    assert!(log.lines().all(|l| l.starts_with("running: ")), "{log}");
}
