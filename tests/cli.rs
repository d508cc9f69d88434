//! The `queueguard` binary: `apply` against the real broker, its exit codes and messages, `crd`
//! and `--help`.

mod common;

use common::*;
use std::{
    io::Write,
    process::{Command, Output, Stdio},
};

fn queueguard(args: &[&str], stdin: Option<&str>) -> Output {
    let env = [("QUEUEGUARD_BROKER_URI", broker_uri()), ("QUEUEGUARD_MANAGEMENT_URI", management_base())];
    run_binary(args, &env, stdin)
}

fn manifest(name: &str, queue: &str) -> String {
    format!(
        "apiVersion: queueguard.io/v1alpha1\nkind: QueuePolicy\nmetadata: {{name: {name:?}, namespace: test}}\nspec:\n  broker: {{secretRef: {{name: rabbitmq}}}}\n  queue: {queue}\n"
    )
}

fn statuses(out: &Output) -> Vec<serde_json::Value> {
    let text = String::from_utf8(out.stdout.clone()).unwrap();
    serde_yaml_ng::Deserializer::from_str(&text).map(|d| serde::Deserialize::deserialize(d).unwrap()).collect()
}

fn condition<'a>(status: &'a serde_json::Value, kind: &str) -> &'a serde_json::Value {
    status["conditions"].as_array().unwrap().iter().find(|c| c["type"] == kind).unwrap()
}

#[test]
fn apply_declares_and_reports_ready_and_is_idempotent() {
    let name = unique("cli-apply");
    let input = manifest(&name, "{expires: 45m}");
    for _ in 0..2 {
        let out = queueguard(&["apply", "-f", "-"], Some(&input));
        assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
        let s = statuses(&out);
        assert_eq!(s.len(), 1);
        assert_eq!(condition(&s[0], "Ready")["status"], "True");
        assert_eq!(s[0]["queue"]["name"], serde_json::json!(name));
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains(&format!("# QueuePolicy test/{name}")));
        assert!(!text.contains("guest"), "no credentials in the output");
    }
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(remove_all(&plan_of(&policy(&name, "{}"))));
}

#[test]
fn apply_reads_the_broker_from_a_secret_in_the_input_and_files_by_path() {
    let name = unique("cli-secret");
    let dir = std::env::temp_dir().join(unique("cli-file"));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("policy.yaml");
    let secret = format!(
        "apiVersion: v1\nkind: Secret\nmetadata: {{name: rabbitmq, namespace: test}}\nstringData:\n  uri: {}\n  managementUri: {}\n---\n",
        broker_uri(),
        management_base()
    );
    std::fs::write(&file, secret + &manifest(&name, "{}")).unwrap();
    let out =
        Command::new(env!("CARGO_BIN_EXE_queueguard")).args(["apply", "-f", file.to_str().unwrap()]).output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stdout));
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(remove_all(&plan_of(&policy(&name, "{}"))));
}

#[test]
fn invalid_specs_exit_1_with_clear_errors_and_touch_nothing_on_the_broker() {
    let names: Vec<String> = (0..4).map(|i| unique(&format!("cli-invalid{i}"))).collect();
    let long = "x".repeat(256);
    let input = [
        manifest(&names[0], "{expires: 30 minutes}"),
        manifest(&names[1], "{expires: 10s}"),
        manifest(&names[2], &format!("{{name: {long}}}")),
        manifest(&names[3], "{maxLength: 10, overflow: reject-publish-dlx, type: quorum}"),
        manifest("empty-name", "{name: ''}"),
    ]
    .join("---\n");
    let out = queueguard(&["apply", "-f", "-"], Some(&input));
    assert_eq!(out.status.code(), Some(1));
    let s = statuses(&out);
    let messages: Vec<String> = s
        .iter()
        .map(|st| {
            let ready = condition(st, "Ready");
            assert_eq!((ready["status"].as_str(), ready["reason"].as_str()), (Some("False"), Some("InvalidSpec")));
            ready["message"].as_str().unwrap().to_owned()
        })
        .collect();
    assert!(messages[0].starts_with("spec.queue.expires: invalid duration \"30 minutes\""), "{}", messages[0]);
    assert_eq!(messages[1], "spec.queue.expires: must be at least 1m");
    assert!(
        messages[2].starts_with("spec.queue.name: queue name") && messages[2].contains("256 bytes"),
        "{}",
        messages[2]
    );
    assert!(messages[3].contains("quorum queues do not support reject-publish-dlx"), "{}", messages[3]);
    assert!(messages[4].starts_with("spec.queue.name: must not be empty"), "{}", messages[4]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        for name in &names {
            assert!(!exists(name).await, "{name} must not be declared");
            assert!(!exists(&format!("{name}.dlq")).await);
            assert!(mgmt_get(&format!("policies/%2F/{}", enc(&format!("queueguard.test.{name}")))).await.is_none());
        }
    });
}

#[test]
fn a_secret_without_the_uri_key_is_reported_and_touches_nothing() {
    let name = unique("cli-nokey");
    let input = format!(
        "apiVersion: v1\nkind: Secret\nmetadata: {{name: rabbitmq, namespace: test}}\nstringData: {{url: x}}\n---\n{}",
        manifest(&name, "{}")
    );
    let out = Command::new(env!("CARGO_BIN_EXE_queueguard"))
        .args(["apply", "-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            c.stdin.take().unwrap().write_all(input.as_bytes())?;
            c.wait_with_output()
        })
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let s = statuses(&out);
    let ready = condition(&s[0], "Ready");
    assert_eq!(ready["reason"], "SecretKeyMissing");
    assert!(ready["message"].as_str().unwrap().contains("no key 'uri'"));
    let rt = tokio::runtime::Runtime::new().unwrap();
    assert!(!rt.block_on(exists(&name)));
}

#[test]
fn unreadable_input_exits_2_naming_document_and_field() {
    let bad_type = format!("{}---\n{}", manifest("a", "{}"), manifest("b", "{type: fifo}"));
    let out = queueguard(&["apply", "-f", "-"], Some(&bad_type));
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("-: document 2: spec.queue.type: unknown variant `fifo`, expected `classic` or `quorum`"),
        "{err}"
    );

    let typo = manifest("a", "{expire: 1h}");
    let out = queueguard(&["apply", "-f", "-"], Some(&typo));
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("document 1: spec.queue.expire: unknown field"));

    let out = queueguard(&["apply", "-f", "-"], Some("kind: QueuePolicy\nspec: [unclosed"));
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("line 2"), "{}", String::from_utf8_lossy(&out.stderr));

    let out = queueguard(&["apply", "-f", "/nonexistent/policy.yaml"], None);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/policy.yaml"));
}

#[test]
fn a_conflict_exits_1() {
    let name = unique("cli-conflict");
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let (_c, ch) = app().await;
        let mut args = lapin::types::FieldTable::default();
        args.insert("x-max-length".into(), lapin::types::AMQPValue::LongInt(3));
        let durable = lapin::options::QueueDeclareOptions { durable: true, ..Default::default() };
        ch.queue_declare(name.as_str().into(), durable, args).await.unwrap();
    });
    let out = queueguard(&["apply", "-f", "-"], Some(&manifest(&name, "{}")));
    assert_eq!(out.status.code(), Some(1));
    let s = statuses(&out);
    assert_eq!(condition(&s[0], "QueueDeclared")["reason"], "ArgumentsConflict");
    rt.block_on(remove_all(&plan_of(&policy(&name, "{}"))));
}

#[test]
fn crd_prints_the_committed_crd_and_help_explains_each_command() {
    let read = |f: &str| std::fs::read_to_string(format!("{}/crds/{f}", env!("CARGO_MANIFEST_DIR"))).unwrap();
    let (policy, pattern) = (read("queuepolicy.yaml"), read("queuepattern.yaml"));
    let printed = |args: &[&str]| String::from_utf8(queueguard(args, None).stdout).unwrap();
    assert_eq!(printed(&["crd", "--kind", "queue-policy"]), policy);
    assert_eq!(printed(&["crd", "--kind", "queue-pattern"]), pattern);
    assert_eq!(printed(&["crd"]), format!("{policy}{pattern}"), "both, ready for kubectl apply -f -");
    let help = String::from_utf8(queueguard(&["--help"], None).stdout).unwrap();
    for command in ["run", "crd", "apply", "consumers", "demo", "check", "status", "uninstall"] {
        assert!(help.lines().any(|l| l.trim_start().starts_with(command)), "{command} in {help}");
    }
    let apply_help = String::from_utf8(queueguard(&["apply", "--help"], None).stdout).unwrap();
    assert!(apply_help.contains("--broker") && apply_help.contains("--management") && apply_help.contains("Exit 0"));
}

/// A durable queue declared as an application would, with `messages` in it.
fn app_queue(name: &str, arguments: lapin::types::FieldTable, messages: usize) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let (_c, ch) = app().await;
        let durable = lapin::options::QueueDeclareOptions { durable: true, ..Default::default() };
        ch.queue_declare(name.into(), durable, arguments).await.unwrap();
        ch.confirm_select(Default::default()).await.unwrap();
        for i in 0..messages {
            let body = format!("m-{i}");
            let sent =
                ch.basic_publish("".into(), name.into(), Default::default(), body.as_bytes(), Default::default());
            sent.await.unwrap().await.unwrap();
        }
    });
}

fn queue_of(name: &str) -> serde_json::Value {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(mgmt_get(&format!("queues/%2F/{}", enc(name)))).expect("the queue exists")
}

fn remove_queue(name: &str) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let (_c, ch) = app().await;
        let _ = ch.queue_delete(name.into(), Default::default()).await;
    });
}

#[test]
fn migrate_prints_the_plan_on_a_dry_run_then_moves_the_queue_and_its_messages() {
    let name = unique("cli-migrate");
    let mut arguments = lapin::types::FieldTable::default();
    arguments.insert("x-max-length".into(), lapin::types::AMQPValue::LongInt(1000));
    arguments.insert("x-queue-mode".into(), lapin::types::AMQPValue::LongString("lazy".into()));
    app_queue(&name, arguments, 25);

    let out = queueguard(&["migrate", &name, "--to", "quorum", "--dry-run"], None);
    let plan = String::from_utf8_lossy(&out.stdout).to_string();
    assert_eq!(out.status.code(), Some(0), "{plan}{}", String::from_utf8_lossy(&out.stderr));
    assert!(plan.contains("classic {x-max-length: 1000, x-queue-mode: lazy} → quorum {x-max-length: 1000}"), "{plan}");
    assert!(plan.contains("left behind (quorum queues do not take them): x-queue-mode"), "{plan}");
    // Issue 31, 12: what the broker here (a vhost whose default queue type is classic, or
    // none) will do with the workers' plain declares afterwards.
    assert!(plan.contains("note: once it is quorum, RabbitMQ ") && plan.contains("x-queue-type: quorum"), "{plan}");
    assert_eq!(queue_of(&name)["type"], "classic", "a dry run changes nothing");

    let out = queueguard(&["migrate", &name, "--to", "quorum"], None);
    let said = String::from_utf8_lossy(&out.stdout).to_string();
    assert_eq!(out.status.code(), Some(0), "{said}{}", String::from_utf8_lossy(&out.stderr));
    assert!(said.contains("migrated: moved out 25, moved back 25"), "{said}");
    assert!(said.contains("summary migrated=1 moved_out=25 moved_back=25 dropped=0"), "{said}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("Swapping"), "each step is told");
    let q = queue_of(&name);
    assert_eq!((q["type"].as_str(), q["arguments"]["x-max-length"].as_i64()), (Some("quorum"), Some(1000)));
    let ready = eventually_value(|| queue_of(&name)["messages_ready"].as_i64());
    assert_eq!(ready, Some(25), "every message is in the new queue");

    let again = queueguard(&["migrate", &name, "--to", "quorum"], None);
    assert_eq!(again.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&again.stdout).contains("nothing to do"));
    remove_queue(&name);
}

/// The management API's statistics lag: the value once it is there (up to 15 s).
fn eventually_value(read: impl Fn() -> Option<i64>) -> Option<i64> {
    for _ in 0..75 {
        if let Some(v) = read().filter(|v| *v > 0) {
            return Some(v);
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    read()
}

#[test]
fn migrate_refuses_what_the_new_type_cannot_take_and_a_missing_queue_touching_nothing() {
    let name = unique("cli-migrate-priority");
    let mut arguments = lapin::types::FieldTable::default();
    arguments.insert("x-max-priority".into(), lapin::types::AMQPValue::LongInt(5));
    app_queue(&name, arguments, 3);
    let out = queueguard(&["migrate", &name, "--to", "quorum"], None);
    assert_eq!(out.status.code(), Some(1));
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(said.contains("refused:") && said.contains("priority"), "{said}");
    assert_eq!(queue_of(&name)["type"], "classic");
    assert!(
        tokio::runtime::Runtime::new()
            .unwrap()
            .block_on(mgmt_get(&format!("queues/%2F/{}", enc(&format!("{name}.queueguard-migrating")))))
            .is_none(),
        "no holding queue"
    );
    remove_queue(&name);

    let out = queueguard(&["migrate", &unique("cli-migrate-none"), "--to", "quorum"], None);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not found in vhost '/'"));
}

#[test]
fn apply_with_migrate_changes_the_type_and_says_the_consumers_must_be_restarted() {
    let name = unique("cli-apply-migrate");
    assert_eq!(queueguard(&["apply", "-f", "-"], Some(&manifest(&name, "{type: classic}"))).status.code(), Some(0));
    let refused = queueguard(&["apply", "-f", "-"], Some(&manifest(&name, "{type: quorum}")));
    assert_eq!(refused.status.code(), Some(1), "Refuse, the default, keeps today's conflict");
    let out = queueguard(&["apply", "-f", "-"], Some(&manifest(&name, "{type: quorum, onChange: Migrate}")));
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let s = statuses(&out);
    assert_eq!(s[0]["migration"]["phase"], "Completed");
    assert!(s[0]["migration"]["message"].as_str().unwrap().contains("must be restarted"));
    assert_eq!(condition(&s[0], "Migrating")["reason"], "MigrationCompleted");
    assert_eq!(queue_of(&name)["type"], "quorum");
    assert_eq!(queue_of(&format!("{name}.dlq"))["type"], "quorum");
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(remove_all(&plan_of(&policy(&name, "{type: quorum}"))));
}

/// Issue 31, 8: two policies share a dead-letter queue and both say Migrate, one quorum and one
/// classic. The shared queue is not swapped back and forth at every run: the policy whose change
/// would move it is refused, naming the other, and the queue keeps the shape it has.
#[test]
fn a_shared_dead_letter_queue_of_two_types_is_refused_not_swapped_back_and_forth() {
    let (a, b) = (unique("cli-shared-a"), unique("cli-shared-b"));
    let dead = unique("cli-shared-dead");
    let queue = |ty: &str| format!("{{type: {ty}, onChange: Migrate, deadLetter: {{queue: {dead}}}}}");
    let both = |ta: &str, tb: &str| format!("{}---\n{}", manifest(&a, &queue(ta)), manifest(&b, &queue(tb)));
    let out = queueguard(&["apply", "-f", "-"], Some(&both("classic", "classic")));
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    for _ in 0..3 {
        let out = queueguard(&["apply", "-f", "-"], Some(&both("quorum", "classic")));
        let s = statuses(&out);
        let refused = &s[0]["migration"];
        assert_eq!(refused["phase"], "Refused", "{s:?}");
        let message = refused["message"].as_str().unwrap();
        assert!(message.contains(&format!("also declared by QueuePolicy test/{b}, as classic")), "{message}");
        assert_eq!(condition(&s[0], "Migrating")["reason"], "MigrationRefused");
        assert_eq!(queue_of(&dead)["type"], "classic", "the shared queue keeps its shape");
    }
    assert_eq!(queue_of(&a)["type"], "classic", "nothing of a's moved while its dead-letter queue is refused");
    let rt = tokio::runtime::Runtime::new().unwrap();
    for name in [&a, &b] {
        rt.block_on(remove_all(&plan_of(&policy(name, &queue("classic")))));
    }
}
