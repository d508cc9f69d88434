//! The `queueguard check` binary: exit codes 0/1/2, text and JSON output, stdin, `kind: List`,
//! `helm template` output with comment-only documents, objects spread over several files, and
//! the message for input it cannot read. No broker and no cluster needed.

mod common;

use queueguard::check::Rule;
use serde_json::{Value, json};
use std::{path::PathBuf, process::Output};

fn fixture(name: &str) -> String {
    format!("{}/tests/fixtures/check/{name}", env!("CARGO_MANIFEST_DIR"))
}

fn check(args: &[&str], stdin: Option<&str>) -> Output {
    let args: Vec<&str> = std::iter::once("check").chain(args.iter().copied()).collect();
    common::run_binary(&args, &[], stdin)
}

fn stdout(out: &Output) -> String {
    String::from_utf8(out.stdout.clone()).unwrap()
}

fn stderr(out: &Output) -> String {
    String::from_utf8(out.stderr.clone()).unwrap()
}

/// (file, "severity ID rule-name", object) of each line of text output.
fn lines(out: &Output) -> Vec<(String, String, String)> {
    stdout(out)
        .lines()
        .map(|line| {
            let mut parts = line.splitn(4, ": ");
            let mut next = || parts.next().unwrap_or_default().to_owned();
            (next(), next(), next())
        })
        .collect()
}

fn json_of(out: &Output) -> Vec<Value> {
    serde_json::from_str::<Value>(&stdout(out)).unwrap().as_array().unwrap().clone()
}

/// A file of its own in the temporary directory.
fn temp_file(name: &str, text: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("queueguard-check-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn clean_helm_template_output_exits_0_and_says_what_it_checked() {
    let clean = fixture("clean.yaml");
    let out = check(&[&clean], None);
    assert_eq!(out.status.code(), Some(0), "{}{}", stdout(&out), stderr(&out));
    assert_eq!(stdout(&out), "");
    assert_eq!(stderr(&out), "no findings in 3 objects (1 QueuePolicy, 1 workload)\n");
    let out = check(&["-o", "json", &clean], None);
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(json_of(&out), Vec::<Value>::new());
}

#[test]
fn findings_exit_1_one_line_each_in_input_order() {
    let unsafe_ = fixture("unsafe.yaml");
    let out = check(&[&unsafe_], None);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let expect = |rule: &str, object: &str| (unsafe_.clone(), rule.to_owned(), object.to_owned());
    assert_eq!(
        lines(&out),
        [
            expect("error QG005 expires-shorter-than-rollout", "QueuePolicy shop/orders"),
            expect("error QG006 expiring-dead-letter-queue", "QueuePolicy shop/orders"),
            expect("error QG007 dead-letter-loop", "QueuePolicy shop/orders"),
            expect("error QG002 unsafe-rollout-strategy", "Deployment shop/order-worker"),
            expect("error QG003 missing-readiness-gate", "Deployment shop/order-worker"),
        ]
    );
    let text = stdout(&out);
    assert!(
        text.contains(": QueuePolicy shop/orders: queue 'orders' expires after 1m without consumers, but a rollout of Deployment 'order-worker' may take about 5m35s: 1 step (all 2 replaced at once) of 5m35s each (30s terminationGracePeriodSeconds + 5m start-up (startupProbe of container 'worker': 0s + 30 × 10s) + 5s minAttachedSeconds)."),
        "{text}"
    );
    assert!(text.contains("Set spec.queue.expires to at least 6m.\n"), "{text}");
    assert_eq!(stderr(&out), "5 findings (5 errors, 0 warnings) in 3 objects (2 QueuePolicies, 1 workload)\n");
}

#[test]
fn json_output_is_an_array_of_findings_with_rule_object_and_file() {
    let unsafe_ = fixture("unsafe.yaml");
    let out = check(&["-o", "json", &unsafe_], None);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let findings = json_of(&out);
    assert_eq!(findings.len(), 5);
    for f in &findings {
        let mut keys: Vec<&str> = f.as_object().unwrap().keys().map(String::as_str).collect();
        keys.sort_unstable();
        assert_eq!(keys, ["file", "kind", "message", "name", "namespace", "rule", "ruleName", "severity"]);
    }
    let mut strategy = findings.iter().find(|f| f["rule"] == "QG002").unwrap().clone();
    let message = strategy.as_object_mut().unwrap().remove("message").unwrap();
    assert_eq!(
        strategy,
        json!({"rule": "QG002", "ruleName": "unsafe-rollout-strategy", "severity": "error", "kind": "Deployment",
               "namespace": "shop", "name": "order-worker", "file": unsafe_})
    );
    assert!(
        message.as_str().unwrap().starts_with("strategy Recreate stops every old pod before any new one starts (QueuePolicy 'orders' guards it with minAttached 1)"),
        "{message}"
    );
    assert_eq!(stderr(&out), "", "JSON output adds nothing on stderr");
}

#[test]
fn queue_patterns_are_read_and_checked_with_the_policies() {
    let patterns = fixture("patterns.yaml");
    let out = check(&[&patterns], None);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let expect = |rule: &str, object: &str| (patterns.clone(), rule.to_owned(), object.to_owned());
    assert_eq!(
        lines(&out),
        [
            expect("error QG006 expiring-dead-letter-queue", "QueuePolicy shop/orders"),
            expect("warning QG012 unanchored-pattern", "QueuePattern shop/order-queues"),
        ]
    );
    let text = stdout(&out);
    assert!(
        text.contains(": QueuePolicy shop/orders: its dead-letter queue 'orders.dlq' expires: QueuePattern 'order-queues' matches it (pattern 'orders\\.', priority 0;"),
        "{text}"
    );
    assert!(text.contains("which gives it expires 1h."), "{text}");
    assert_eq!(
        stderr(&out),
        "2 findings (1 error, 1 warning) in 4 objects (1 QueuePolicy, 2 QueuePatterns, 1 workload)\n"
    );

    let out = check(&["-o", "json", &patterns], None);
    let findings = json_of(&out);
    let unanchored = findings.iter().find(|f| f["rule"] == "QG012").unwrap();
    assert_eq!(
        (&unanchored["kind"], &unanchored["namespace"], &unanchored["name"], &unanchored["severity"]),
        (&json!("QueuePattern"), &json!("shop"), &json!("order-queues"), &json!("warning"))
    );

    // Anchored so that it leaves the dead-letter queue alone: clean.
    let text = std::fs::read_to_string(&patterns).unwrap();
    let anchored = text.replace(r"pattern: 'orders\.'", r"pattern: '^orders\.[0-9]+$'");
    let out = check(&["-"], Some(&anchored));
    assert_eq!(out.status.code(), Some(0), "{}", stdout(&out));

    // An invalid QueuePattern and one of an unserved version are QG001, named as QueuePatterns.
    let invalid = text
        .replacen("queueguard.io/v1alpha1\nkind: QueuePattern", "queueguard.io/v1beta1\nkind: QueuePattern", 1)
        .replace("expires: 1h", "expires: 1h\n  priority: 100");
    let out = check(&["-o", "json", "-"], Some(&invalid));
    let findings = json_of(&out);
    let found: Vec<(&Value, &Value, &Value)> = findings.iter().map(|f| (&f["rule"], &f["kind"], &f["name"])).collect();
    assert_eq!(
        found,
        [
            (&json!("QG001"), &json!("QueuePattern"), &json!("replies")),
            (&json!("QG001"), &json!("QueuePattern"), &json!("order-queues"))
        ],
        "an invalid pattern puts no policy on the broker: no QG006, no QG012"
    );
    assert!(
        findings[0]["message"].as_str().unwrap().starts_with(
            "apiVersion queueguard.io/v1beta1 is not served: queueguard's QueuePattern is queueguard.io/v1alpha1"
        ),
        "{findings:#?}"
    );
    assert!(
        findings[1]["message"].as_str().unwrap().contains("spec.priority: must be between 0 and 99"),
        "{findings:#?}"
    );

    // A wrongly typed field of a QueuePattern is unreadable input, with its line.
    let out = check(&["-"], Some(&text.replace("maxLength: 1000", "maxLength: lots")));
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).starts_with("error: <stdin>: line 32, column 14: spec.maxLength: invalid type"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn a_kubectl_list_read_from_stdin_is_flattened() {
    let list = std::fs::read_to_string(fixture("list.yaml")).unwrap();
    let out = check(&["-o", "json", "-"], Some(&list));
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let findings = json_of(&out);
    assert_eq!(findings.len(), 1, "{findings:#?}");
    let f = &findings[0];
    assert_eq!(
        (&f["rule"], &f["kind"], &f["namespace"], &f["name"], &f["file"]),
        (&json!("QG004"), &json!("Deployment"), &json!("shop"), &json!("order-worker"), &json!("<stdin>"))
    );
    assert!(f["message"].as_str().unwrap().contains("QueuePolicy 'orders' guarding it is in gate.mode Observe"), "{f}");
    // The same List with the policy enforcing is clean: status, managedFields and the Pod are no
    // findings.
    let enforcing = list.replace("mode: Observe", "mode: Enforce");
    let out = check(&["-"], Some(&enforcing));
    assert_eq!(out.status.code(), Some(0), "{}", stdout(&out));
    assert_eq!(stderr(&out), "no findings in 3 objects (1 QueuePolicy, 1 workload)\n");
}

#[test]
fn objects_in_several_files_are_checked_together() {
    let policy = "---\n# Source: shop/templates/queuepolicy.yaml\napiVersion: queueguard.io/v1alpha1\nkind: QueuePolicy\nmetadata: {name: orders}\nspec:\n  broker: {secretRef: {name: rabbitmq}}\n  queue: {name: orders}\n  consumers: {selector: {matchLabels: {app.kubernetes.io/component: consumer}}}\n---\n# Source: shop/templates/empty.yaml\n";
    let deployment = "# Source: shop/templates/deployment.yaml\napiVersion: apps/v1\nkind: Deployment\nmetadata: {name: order-worker, labels: {app.kubernetes.io/component: consumer}}\nspec:\n  replicas: 2\n  selector: {matchLabels: {app: order-worker}}\n  template:\n    metadata: {labels: {app: order-worker}}\n    spec: {containers: [{name: worker, image: worker}]}\n";
    let file = temp_file("deployment.yaml", deployment);
    let file = file.to_str().unwrap();
    let out = check(&["-", file], Some(policy));
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert_eq!(
        lines(&out),
        [(file.to_owned(), "error QG003 missing-readiness-gate".to_owned(), "Deployment order-worker".to_owned())]
    );
    // Alone, neither file has a finding: the Deployment is guarded by nothing it can see.
    assert_eq!(check(&[file], None).status.code(), Some(0));
    assert_eq!(check(&["-"], Some(policy)).status.code(), Some(0));
}

#[test]
fn unreadable_input_exits_2_naming_the_file_and_the_line() {
    let broken = fixture("broken.yaml");
    let out = check(&[&fixture("clean.yaml"), &broken], None);
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(stdout(&out), "");
    assert_eq!(
        stderr(&out),
        format!("error: {broken}: line 7, column 13: spec.replicas: invalid type: string \"three\", expected i32\n")
    );

    let out = check(&["-"], Some("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: a}\n---\nkind: [unclosed\n"));
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        stderr(&out),
        "error: <stdin>: line 6, column 1: did not find expected ',' or ']', while parsing a flow sequence at line 5 column 7\n"
    );

    let out = check(&["-"], Some("apiVersion: v1\nkind: ConfigMap\n---\n# values.yaml by mistake\nreplicaCount: 2\n"));
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(stderr(&out), "error: <stdin>: line 5, column 1: not a Kubernetes object: kind is missing\n");

    let missing = fixture("no-such-file.yaml");
    let out = check(&[&missing], None);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).starts_with(&format!("error: {missing}: No such file")), "{}", stderr(&out));
}

#[test]
fn empty_input_is_an_error_not_a_clean_bill() {
    // `helm template ... | queueguard check -` where helm failed.
    let out = check(&["-"], Some("---\n# Source: shop/templates/empty.yaml\n"));
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(
        stderr(&out),
        "error: <stdin>: no Kubernetes objects found (empty input: did the command that produced it fail?)\n"
    );
}

#[test]
fn help_explains_the_command_and_lists_every_rule() {
    let out = check(&["--help"], None);
    assert_eq!(out.status.code(), Some(0));
    let help = stdout(&out);
    assert!(help.contains("Lint manifests before they reach a cluster"), "{help}");
    assert!(help.contains("-o, --output <OUTPUT>"), "{help}");
    for rule in Rule::ALL {
        assert!(help.contains(&format!("{} {}", rule.id(), rule.name())), "{} missing: {help}", rule.id());
    }
    assert!(help.contains("Exit status: 0 no findings, 1 findings"), "{help}");
    // FILE is required.
    assert_eq!(check(&[], None).status.code(), Some(2));
}
