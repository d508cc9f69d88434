//! The fault-matrix soak as CI runs it: a short run (six guarded restarts, two live migrations,
//! every fault kind of a single broker) against the real broker, which must account for every
//! message the broker confirmed. The long run and its figures are in the README.

mod common;

use std::collections::BTreeMap;

#[test]
fn a_short_soak_with_every_fault_loses_nothing() {
    let env =
        [("QUEUEGUARD_BROKER_URI", common::broker_uri()), ("QUEUEGUARD_MANAGEMENT_URI", common::management_base())];
    let args = ["soak", "--restarts", "6", "--migrations", "2", "--replicas", "2", "--seed", "31"];
    let out = common::run_binary(&args, &env, None);
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let said = format!("{stdout}{}", String::from_utf8_lossy(&out.stderr));
    println!("{said}");
    assert_eq!(out.status.code(), Some(0), "{said}");
    let summary: BTreeMap<&str, u64> = stdout
        .lines()
        .find_map(|l| l.strip_prefix("summary "))
        .expect("a summary line")
        .split_whitespace()
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k, v.parse().unwrap()))
        .collect();
    assert_eq!((summary["restarts"], summary["migrations"]), (6, 2));
    for fault in ["consumer_killed", "slow_consumers", "operator_restarted", "migration_stopped", "migration_cut"] {
        assert!(summary[fault] > 0, "{fault} was injected: {summary:?}");
    }
    assert!(summary["published"] > 1000, "{summary:?}");
    assert_eq!(summary["lost"], 0, "{said}");
    assert_eq!(summary["premature_opens"], 0, "{said}");
    let accounted = summary["consumed"] + summary["dead_lettered"] + summary["left"];
    assert_eq!(accounted, summary["published"], "every confirmed message accounted for: {summary:?}");
}
