use super::*;
use serde_json::json;

fn shape(queue_type: &str, args: Value) -> Shape {
    Shape {
        queue_type: queue_type.into(),
        durable: true,
        auto_delete: false,
        exclusive: false,
        arguments: args.as_object().cloned().unwrap_or_default(),
    }
}

fn target(queue_type: QueueType, args: Value) -> Target {
    Target { queue: "orders".into(), queue_type, arguments: args.as_object().cloned().unwrap_or_default() }
}

fn flag(state: &str) -> Vec<FeatureFlag> {
    vec![FeatureFlag { name: "quorum_queue".into(), state: state.into() }]
}

#[test]
fn differences_name_each_fixed_setting_that_changes() {
    let now = shape("classic", json!({"x-max-length": 10, "x-expires": 1800000}));
    assert_eq!(
        differences(&now, &target(QueueType::Classic, json!({"x-max-length": 10, "x-expires": 1800000}))),
        Vec::<String>::new()
    );
    assert_eq!(
        differences(&now, &target(QueueType::Quorum, json!({"x-max-length": 20, "x-expires": 1800000}))),
        ["type: classic → quorum", "x-max-length: 10 → 20"]
    );
    let mut auto = shape("classic", json!({}));
    auto.auto_delete = true;
    assert_eq!(
        differences(&auto, &target(QueueType::Classic, json!({}))),
        ["durable/auto-delete: true/true → true/false"]
    );
    assert_eq!(
        differences(&now, &target(QueueType::Classic, json!({"x-expires": 1800000}))),
        ["x-max-length: 10 → unset"]
    );
}

#[test]
fn the_type_comes_from_the_listing_or_the_arguments() {
    let info: QueueInfo = serde_json::from_value(json!({
        "name": "orders", "vhost": "/", "durable": true, "arguments": {"x-queue-type": "quorum", "x-max-length": 5}
    }))
    .unwrap();
    let s = Shape::of(&info);
    assert_eq!(s.queue_type, "quorum");
    assert_eq!(s.arguments, *json!({"x-max-length": 5}).as_object().unwrap());
    assert_eq!(s.describe(), "quorum {x-max-length: 5}");
}

#[test]
fn resumes_at_the_earliest_step_the_broker_state_allows() {
    let old = shape("classic", json!({}));
    let new = shape("quorum", json!({}));
    let t = target(QueueType::Quorum, json!({}));
    assert_eq!(resume_at(None, false, &t, None), Resume::NotNeeded);
    assert_eq!(resume_at(Some(&new), false, &t, None), Resume::NotNeeded);
    assert_eq!(resume_at(Some(&old), false, &t, None), Resume::Start);
    assert_eq!(resume_at(Some(&old), true, &t, None), Resume::At(MigrationPhase::Preparing));
    assert_eq!(resume_at(None, true, &t, None), Resume::At(MigrationPhase::Swapping));
    assert_eq!(resume_at(Some(&new), true, &t, None), Resume::At(MigrationPhase::Restoring));

    // The record moves the resume point on within what the broker allows.
    let at = |q, h, r| resume_at(q, h, &t, Some(r));
    assert_eq!(at(Some(&old), true, MigrationPhase::Draining), Resume::At(MigrationPhase::Draining));
    assert_eq!(at(Some(&old), true, MigrationPhase::Swapping), Resume::At(MigrationPhase::Swapping));
    assert_eq!(at(Some(&old), true, MigrationPhase::Refilling), Resume::At(MigrationPhase::Swapping));
    assert_eq!(at(None, true, MigrationPhase::Draining), Resume::At(MigrationPhase::Swapping));
    assert_eq!(at(Some(&new), true, MigrationPhase::Swapping), Resume::At(MigrationPhase::Restoring));
    assert_eq!(at(Some(&new), true, MigrationPhase::Refilling), Resume::At(MigrationPhase::Refilling));
    assert_eq!(at(Some(&new), false, MigrationPhase::Refilling), Resume::NotNeeded);
}

#[test]
fn refusals_come_before_anything_is_touched() {
    let classic = shape("classic", json!({}));
    let quorum = target(QueueType::Quorum, json!({}));
    assert_eq!(refusal(&classic, &quorum, Some(&flag("enabled"))), None);
    assert_eq!(refusal(&classic, &quorum, None), None, "a broker without the listing has quorum queues (4.x)");
    assert!(refusal(&classic, &quorum, Some(&flag("disabled"))).unwrap().contains("enable_feature_flag quorum_queue"));

    let priority = shape("classic", json!({"x-max-priority": 5}));
    let why = refusal(&priority, &quorum, None).unwrap();
    assert!(why.contains("x-max-priority 5") && why.contains("quorum queues have no priorities"), "{why}");
    let why = refusal(&priority, &target(QueueType::Classic, json!({"x-max-length": 3})), None).unwrap();
    assert!(why.contains("no x-max-priority"), "{why}");
    assert_eq!(
        refusal(&priority, &target(QueueType::Classic, json!({"x-max-priority": 5, "x-max-length": 3})), None),
        None
    );

    let dlx = target(QueueType::Quorum, json!({"x-overflow": "reject-publish-dlx", "x-max-length": 3}));
    assert!(refusal(&classic, &dlx, None).unwrap().contains("reject-publish-dlx"));

    let mut exclusive = classic.clone();
    exclusive.exclusive = true;
    assert!(refusal(&exclusive, &quorum, None).unwrap().contains("exclusive"));
    assert!(refusal(&shape("stream", json!({})), &quorum, None).unwrap().contains("stream"));

    let long = Target { queue: "q".repeat(240), ..quorum };
    assert!(refusal(&classic, &long, None).unwrap().contains("255 bytes"));
}

#[test]
fn converting_leaves_behind_what_the_new_type_does_not_take() {
    let lazy = shape("classic", json!({"x-queue-mode": "lazy", "x-max-length": 9, "x-max-priority": 3}));
    let (t, dropped) = Target::converted("orders", &lazy, QueueType::Quorum);
    assert_eq!(dropped, ["x-queue-mode"]);
    assert_eq!(t.arguments, *json!({"x-max-length": 9, "x-max-priority": 3}).as_object().unwrap());
    assert!(refusal(&lazy, &t, None).is_some(), "the priority is refused, not silently dropped");

    let quorum = shape("quorum", json!({"x-delivery-limit": 5, "x-max-length": 9}));
    let (t, dropped) = Target::converted("orders", &quorum, QueueType::Classic);
    assert_eq!(dropped, ["x-delivery-limit"]);
    assert_eq!(t.declare_arguments(), *json!({"x-max-length": 9, "x-queue-type": "classic"}).as_object().unwrap());
}

#[test]
fn the_fence_refuses_publishes_unless_a_declared_overflow_would_drop_instead() {
    let fenced = fence("orders.v2", &shape("classic", json!({}))).unwrap();
    assert_eq!(fenced.pattern, "^orders\\.v2$");
    assert_eq!(fenced.definition, json!({"max-length": 0, "overflow": "reject-publish"}).as_object().unwrap().clone());
    assert!(fence("q", &shape("quorum", json!({"x-overflow": "reject-publish-dlx"}))).is_some());
    assert_eq!(fence("q", &shape("classic", json!({"x-overflow": "drop-head"}))), None);
}

#[test]
fn the_plan_says_from_and_to_what_is_left_behind_and_the_steps() {
    let current = shape("classic", json!({"x-max-length": 10, "x-queue-mode": "lazy"}));
    let (target, dropped) = Target::converted("orders", &current, QueueType::Quorum);
    assert_eq!(dropped, ["x-queue-mode"]);
    let text = plan_text("/", &current, &target, &dropped, None);
    assert!(
        text.starts_with(
            "queue 'orders' in vhost '/': classic {x-max-length: 10, x-queue-mode: lazy} → quorum {x-max-length: 10}\n"
        ),
        "{text}"
    );
    assert!(text.contains("left behind (quorum queues do not take them): x-queue-mode"), "{text}");
    assert!(text.contains("declare 'orders.queueguard-migrating' (quorum)"), "{text}");
    assert!(text.contains("restart the consumers"), "{text}");

    let refused = plan_text("/", &current, &target, &dropped, Some("no"));
    assert!(refused.ends_with("  refused: no\n") && !refused.contains("declare"), "{refused}");
    let same = shape("quorum", json!({"x-max-length": 10}));
    assert!(plan_text("/", &same, &target, &[], None).contains("nothing to do"));
}
