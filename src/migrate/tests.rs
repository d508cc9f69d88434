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
    // Recorded before the holding queue is deleted: the deletion is still to do.
    assert_eq!(at(Some(&new), true, MigrationPhase::RestartingConsumers), Resume::At(MigrationPhase::Refilling));
}

fn none() -> Surroundings<'static> {
    Surroundings::default()
}

fn with_flags(flags: &[FeatureFlag]) -> Surroundings<'_> {
    Surroundings { flags: Some(flags), ..Surroundings::default() }
}

fn policy(name: &str, pattern: &str, priority: i64, definition: Value) -> PolicyInfo {
    PolicyInfo {
        name: name.into(),
        pattern: pattern.into(),
        apply_to: "queues".into(),
        priority,
        definition: definition.as_object().cloned().unwrap(),
    }
}

#[test]
fn refusals_come_before_anything_is_touched() {
    let classic = shape("classic", json!({}));
    let quorum = target(QueueType::Quorum, json!({}));
    assert_eq!(refusal(&classic, &quorum, &with_flags(&flag("enabled"))), None);
    assert_eq!(refusal(&classic, &quorum, &none()), None, "a broker without the listing has quorum queues (4.x)");
    let why = refusal(&classic, &quorum, &with_flags(&flag("disabled"))).unwrap();
    assert!(why.contains("enable_feature_flag quorum_queue"));

    let priority = shape("classic", json!({"x-max-priority": 5}));
    let why = refusal(&priority, &quorum, &none()).unwrap();
    assert!(why.contains("x-max-priority 5") && why.contains("quorum queues have no priorities"), "{why}");
    let why = refusal(&priority, &target(QueueType::Classic, json!({"x-max-length": 3})), &none()).unwrap();
    assert!(why.contains("no x-max-priority"), "{why}");
    assert_eq!(
        refusal(&priority, &target(QueueType::Classic, json!({"x-max-priority": 5, "x-max-length": 3})), &none()),
        None
    );

    let dlx = target(QueueType::Quorum, json!({"x-overflow": "reject-publish-dlx", "x-max-length": 3}));
    assert!(refusal(&classic, &dlx, &none()).unwrap().contains("reject-publish-dlx"));

    let mut exclusive = classic.clone();
    exclusive.exclusive = true;
    assert!(refusal(&exclusive, &quorum, &none()).unwrap().contains("exclusive"));
    assert!(refusal(&shape("stream", json!({})), &quorum, &none()).unwrap().contains("stream"));

    let long = Target { queue: "q".repeat(240), ..quorum.clone() };
    assert!(refusal(&classic, &long, &none()).unwrap().contains("255 bytes"));
}

#[test]
fn consumers_that_would_keep_the_mover_out_are_refused_up_front() {
    let classic = shape("classic", json!({}));
    let quorum = target(QueueType::Quorum, json!({}));
    let consumer = |tag: &str, exclusive: bool| QueueConsumer { consumer_tag: tag.into(), exclusive };
    let exclusive = [consumer("a", false), consumer("worker-1", true)];
    let why = refusal(&classic, &quorum, &Surroundings { consumers: &exclusive, ..none() }).unwrap();
    assert!(why.contains("exclusive consumer ('worker-1')"), "{why}");

    let single = shape("classic", json!({"x-single-active-consumer": true}));
    let attached = [consumer("a", false)];
    let why = refusal(&single, &quorum, &Surroundings { consumers: &attached, ..none() }).unwrap();
    assert!(why.contains("single active consumer"), "{why}");
    assert_eq!(refusal(&single, &quorum, &none()), None, "with nobody attached it moves");
    assert_eq!(refusal(&classic, &quorum, &Surroundings { consumers: &attached, ..none() }), None);
}

#[test]
fn an_operator_policy_that_would_limit_the_holding_queue_is_refused() {
    let classic = shape("classic", json!({}));
    let quorum = target(QueueType::Quorum, json!({}));
    let limits = [policy("cap", "^orders", 1, json!({"max-length": 5}))];
    let why = refusal(&classic, &quorum, &Surroundings { operator_policies: &limits, ..none() }).unwrap();
    assert!(why.contains("operator policy 'cap'") && why.contains("max-length 5"), "{why}");
    let elsewhere = [policy("cap", "^payments$", 1, json!({"max-length": 5}))];
    assert_eq!(refusal(&classic, &quorum, &Surroundings { operator_policies: &elsewhere, ..none() }), None);
    let harmless = [policy("lazy", ".*", 1, json!({"queue-mode": "lazy"}))];
    assert_eq!(refusal(&classic, &quorum, &Surroundings { operator_policies: &harmless, ..none() }), None);
}

#[test]
fn messages_wait_in_the_holding_queue_as_they_would_in_the_queue() {
    let declared = shape("classic", json!({"x-dead-letter-exchange": "mine", "x-message-ttl": 60000}));
    let applying = policy(
        "qg",
        "^orders$",
        100,
        json!({"dead-letter-exchange": "theirs", "dead-letter-routing-key": "dead", "message-ttl": 1000, "max-length": 5}),
    );
    assert_eq!(
        waiting_settings(&declared, Some(&applying)),
        *json!({"dead-letter-exchange": "mine", "dead-letter-routing-key": "dead", "message-ttl": 1000})
            .as_object()
            .unwrap()
    );
    assert!(waiting_settings(&shape("classic", json!({})), None).is_empty());

    let holding = holding_policy("orders.v2", &waiting_settings(&declared, None), 7);
    assert_eq!(holding.pattern, "^orders\\.v2\\.queueguard\\-migrating$");
    assert_eq!(holding.priority, 7);
    assert_eq!(
        holding.definition,
        *json!({"dead-letter-exchange": "mine", "message-ttl": 60000, "overflow": "reject-publish"})
            .as_object()
            .unwrap()
    );
}

#[test]
fn the_migrations_own_policies_outrank_every_other() {
    let policies = [policy("catch-all", ".*", 0, json!({})), policy("huge", "^a", 2_000_000_000, json!({}))];
    assert_eq!(above(&policies), 2_000_000_001);
    assert_eq!(above(&policies[..1]), 999_999_999);
    let own = [policy("queueguard-fence.a@1", "^a$", 2_000_000_001, json!({}))];
    assert_eq!(above(&own), 999_999_999, "an earlier fence is no rival");
}

#[test]
fn converting_leaves_behind_what_the_new_type_does_not_take() {
    let lazy = shape("classic", json!({"x-queue-mode": "lazy", "x-max-length": 9, "x-max-priority": 3}));
    let (t, dropped) = Target::converted("orders", &lazy, QueueType::Quorum);
    assert_eq!(dropped, ["x-queue-mode"]);
    assert_eq!(t.arguments, *json!({"x-max-length": 9, "x-max-priority": 3}).as_object().unwrap());
    assert!(refusal(&lazy, &t, &none()).is_some(), "the priority is refused, not silently dropped");

    let quorum = shape("quorum", json!({"x-delivery-limit": 5, "x-max-length": 9}));
    let (t, dropped) = Target::converted("orders", &quorum, QueueType::Classic);
    assert_eq!(dropped, ["x-delivery-limit"]);
    assert_eq!(t.declare_arguments(), *json!({"x-max-length": 9, "x-queue-type": "classic"}).as_object().unwrap());
}

#[test]
fn the_fence_refuses_publishes_in_two_steps_unless_a_declared_overflow_would_drop_instead() {
    let waiting = json!({"dead-letter-exchange": "dlx"}).as_object().cloned().unwrap();
    let fenced = fence("orders.v2", &shape("classic", json!({})), &waiting, 5, 42);
    assert_eq!(fenced.ready.name, "queueguard-fence.orders.v2@42");
    assert_eq!(fenced.ready.pattern, "^orders\\.v2$");
    assert_eq!(fenced.ready.priority, 5);
    assert_eq!(
        fenced.ready.definition,
        *json!({"dead-letter-exchange": "dlx", "overflow": "reject-publish"}).as_object().unwrap()
    );
    let closed = fenced.closed.unwrap();
    assert_eq!(closed.name, fenced.ready.name);
    assert_eq!(
        closed.definition,
        *json!({"dead-letter-exchange": "dlx", "max-length": 0, "overflow": "reject-publish"}).as_object().unwrap()
    );
    assert!(is_fence_of(&closed, "orders.v2") && !is_fence_of(&closed, "orders"));
    let quorum = fence("q", &shape("quorum", json!({"x-overflow": "reject-publish-dlx"})), &Map::new(), 1, 1);
    assert!(quorum.closed.is_some());
    assert_eq!(fence("q", &shape("classic", json!({"x-overflow": "drop-head"})), &Map::new(), 1, 1).closed, None);
}

#[test]
fn statistics_show_the_fence_once_emitted_with_it_in_force() {
    let fenced = fence("q", &shape("classic", json!({})), &Map::new(), 5, 42);
    let closed = fenced.closed.clone().unwrap();
    let info = |policy: Option<&str>, effective: Value| -> QueueInfo {
        serde_json::from_value(
            json!({"name": "q", "vhost": "/", "policy": policy, "effective_policy_definition": effective}),
        )
        .unwrap()
    };
    assert!(!Fence::shown_in(&info(None, json!({})), &fenced.ready));
    assert!(!Fence::shown_in(&info(Some("queueguard-fence.q@41"), json!({})), &fenced.ready), "an earlier attempt's");
    let ready = info(Some("queueguard-fence.q@42"), json!({"overflow": "reject-publish"}));
    assert!(Fence::shown_in(&ready, &fenced.ready));
    assert!(!Fence::shown_in(&ready, &closed), "not closed yet");
    let shut = info(Some("queueguard-fence.q@42"), json!({"overflow": "reject-publish", "max-length": 0}));
    assert!(Fence::shown_in(&shut, &closed) && Fence::shown_in(&shut, &fenced.ready));
}

#[test]
fn the_plan_says_from_and_to_what_is_left_behind_and_the_steps() {
    let current = shape("classic", json!({"x-max-length": 10, "x-queue-mode": "lazy"}));
    let (target, dropped) = Target::converted("orders", &current, QueueType::Quorum);
    assert_eq!(dropped, ["x-queue-mode"]);
    let bounds = Bounds::default();
    let text = plan_text("/", &current, &target, &dropped, None, &bounds, Some("plain declares are refused"));
    assert!(
        text.starts_with(
            "queue 'orders' in vhost '/': classic {x-max-length: 10, x-queue-mode: lazy} → quorum {x-max-length: 10}\n"
        ),
        "{text}"
    );
    assert!(text.contains("left behind (quorum queues do not take them): x-queue-mode"), "{text}");
    assert!(text.contains("declare 'orders.queueguard-migrating' (quorum, under a policy of its own"), "{text}");
    assert!(text.contains("hold no unacknowledged delivery") && text.contains("at most 60s"), "{text}");
    assert!(text.contains("  note: plain declares are refused\n"), "{text}");
    assert!(text.contains("refuse publishes to 'orders' for a moment"), "{text}");
    let drop_head = shape("classic", json!({"x-overflow": "drop-head", "x-max-length": 10}));
    let (t, _) = Target::converted("orders", &drop_head, QueueType::Quorum);
    assert!(plan_text("/", &drop_head, &t, &[], None, &bounds, None).contains("unfenced"));
    assert!(text.contains("restart the consumers"), "{text}");

    let refused = plan_text("/", &current, &target, &dropped, Some("no"), &bounds, None);
    assert!(refused.ends_with("  refused: no\n") && !refused.contains("declare"), "{refused}");
    let same = shape("quorum", json!({"x-max-length": 10}));
    assert!(plan_text("/", &same, &target, &[], None, &bounds, None).contains("nothing to do"));
}

#[test]
fn a_queue_another_policy_declares_with_another_shape_is_not_migrated_to_this_ones() {
    let mut claims = Claims::default();
    let dead = Target { queue: "dead".into(), ..target(QueueType::Quorum, json!({})) };
    assert_eq!(shared_conflict(&dead, &claims), None);
    claims.shapes.entry("dead".into()).or_default().insert("QueuePolicy shop/b".into(), "quorum".into());
    assert_eq!(shared_conflict(&dead, &claims), None, "the same shape: no conflict");
    claims.shapes.entry("dead".into()).or_default().insert("QueuePolicy shop/c".into(), "classic".into());
    let why = shared_conflict(&dead, &claims).unwrap();
    assert!(why.contains("also declared by QueuePolicy shop/c, as classic") && why.contains("make it quorum"), "{why}");
}

#[test]
fn a_plain_declare_after_the_migration_is_foreseen_as_the_broker_measured_here_takes_it() {
    use QueueType::{Classic, Quorum};
    let three = Some("3.10.8");
    let four = Some("4.0.5");
    let why = plain_declare_refused(Quorum, three, None).unwrap();
    assert!(why.contains("RabbitMQ 3.10.8 refuses") && why.contains("x-queue-type: quorum"), "{why}");
    assert!(plain_declare_refused(Quorum, three, Some("quorum")).is_some(), "3.10 refuses it whatever the default");
    assert_eq!(plain_declare_refused(Classic, three, Some("quorum")), None);
    let why = plain_declare_refused(Quorum, four, Some("classic")).unwrap();
    assert!(why.contains("whose default queue type is classic") && why.contains("must be quorum"), "{why}");
    assert_eq!(plain_declare_refused(Quorum, four, Some("quorum")), None);
    assert!(plain_declare_refused(Classic, four, Some("quorum")).is_some(), "4.0 refuses a classic one there");
    assert_eq!(plain_declare_refused(Classic, four, None), None);
    assert!(plain_declare_refused(Quorum, None, None).is_some(), "unknown: the older rule");
}

#[test]
fn a_migration_that_unwound_is_tried_again_five_minutes_later() {
    use crate::migrate::run::next_attempt;
    use k8s_openapi::{apimachinery::pkg::apis::meta::v1::Time, jiff::Timestamp};
    let ended: Timestamp = "2026-12-07T10:00:00Z".parse().unwrap();
    let m = crate::crd::MigrationStatus {
        phase: MigrationPhase::RolledBack,
        finished_at: Some(Time(ended)),
        ..Default::default()
    };
    let at = |s: &str| s.parse::<Timestamp>().unwrap();
    assert_eq!(next_attempt(&m, at("2026-12-07T10:01:00Z")), Some(at("2026-12-07T10:05:00Z")));
    assert_eq!(next_attempt(&m, at("2026-12-07T10:05:00Z")), None, "due");
    let completed = crate::crd::MigrationStatus { phase: MigrationPhase::Completed, ..m.clone() };
    assert_eq!(next_attempt(&completed, at("2026-12-07T10:01:00Z")), None, "only after unwinding");
}
