//! The broker side of reconciliation against the real RabbitMQ: what gets declared, how settings
//! reach the queue, what conflicts look like, and that nothing is ever lost or re-created.

mod common;

use common::*;
use futures::StreamExt;
use lapin::{
    options::{BasicCancelOptions, BasicConsumeOptions, BasicGetOptions, BasicRejectOptions, QueueDeclareOptions},
    types::{AMQPValue, FieldTable},
};
use queueguard::{
    broker::management::LISTING_MAX_AGE,
    broker::{BrokerCredentials, BrokerPool},
    claims::Claims,
    consumers::TrackerPool,
    converge::{self, Cleanup, Mode},
    pattern::crd::QueuePattern,
    status::{Reason, Truth},
};
use serde_json::{Value, json};
use std::{
    sync::Arc,
    time::{Duration, Instant},
};

#[tokio::test]
async fn policy_mode_puts_every_setting_in_an_operator_policy() {
    let name = unique("policy-mode");
    let p = policy(
        &name,
        "{expires: 10m, messageTtl: 1m, maxLength: 100, overflow: reject-publish, bindings: [{exchange: amq.topic, routingKey: orders.*}]}",
    );
    let plan = plan_of(&p);
    let pool = BrokerPool::new(unique("conn"));
    let broker = broker(&pool, &plan);

    let outcome = converge::converge(&plan, &broker, &[], Mode::Declare).await;
    assert!(outcome.is_ready(), "{outcome:#?}");
    assert_eq!(outcome.settings.reason, Reason::PolicyApplied);

    let q = mgmt_get(&format!("queues/%2F/{}", enc(&name))).await.unwrap();
    assert_eq!(
        (q["durable"].clone(), q["auto_delete"].clone(), q["exclusive"].clone()),
        (json!(true), json!(false), json!(false))
    );
    assert_eq!(q["arguments"], json!({"x-queue-type": "classic"}), "Policy mode declares only the type");
    let pol = mgmt_get(&format!("policies/%2F/{}", enc(&plan.policy_name))).await.unwrap();
    assert_eq!(pol["apply-to"], json!("queues"));
    assert_eq!(
        pol["definition"],
        json!({"expires": 600000, "message-ttl": 60000, "max-length": 100, "overflow": "reject-publish",
               "dead-letter-exchange": format!("{name}.dlx"), "dead-letter-routing-key": name})
    );
    // The broker reports the effective policy with its next statistics emission.
    let effective = eventually(Duration::from_secs(12), || async {
        mgmt_get(&format!("queues/%2F/{}", enc(&name))).await.is_some_and(|q| q["policy"] == json!(plan.policy_name))
    })
    .await;
    assert!(effective, "the queue's effective policy is the operator's");
    let bindings = mgmt_get(&format!("queues/%2F/{}/bindings", enc(&name))).await.unwrap();
    assert!(
        bindings.as_array().unwrap().iter().any(|b| b["source"] == "amq.topic" && b["routing_key"] == "orders.*"),
        "{bindings}"
    );
    let dlx = mgmt_get(&format!("exchanges/%2F/{}", enc(&format!("{name}.dlx")))).await.unwrap();
    assert_eq!((dlx["type"].clone(), dlx["durable"].clone()), (json!("direct"), json!(true)));

    // Re-applying changes nothing.
    let again = converge::converge(&plan, &broker, &outcome.applied_bindings.clone().unwrap(), Mode::Declare).await;
    assert!(again.is_ready());
    assert_eq!(mgmt_get(&format!("policies/%2F/{}", enc(&plan.policy_name))).await.unwrap(), pol);
    assert_eq!(mgmt_get(&format!("queues/%2F/{}", enc(&name))).await.unwrap()["arguments"], q["arguments"]);

    remove_all(&plan).await;
}

#[tokio::test]
async fn policy_mode_lets_applications_declare_the_queue_plainly() {
    let name = unique("plain-declare");
    let plan = plan_of(&policy(&name, "{}"));
    let pool = BrokerPool::new(unique("conn"));
    let broker = broker(&pool, &plan);
    assert!(converge::converge(&plan, &broker, &[], Mode::Declare).await.is_ready());

    let (_conn, ch) = app().await;
    let durable = QueueDeclareOptions { durable: true, ..Default::default() };
    ch.queue_declare(name.as_str().into(), durable, FieldTable::default())
        .await
        .expect("a plain durable declare is equivalent");
    assert!(converge::converge(&plan, &broker, &[], Mode::Declare).await.is_ready());
    remove_all(&plan).await;
}

#[tokio::test]
async fn arguments_mode_declares_x_arguments_and_plain_declares_meet_the_documented_conflict() {
    let name = unique("args-mode");
    let plan = plan_of(&policy(&name, "{settings: Arguments, expires: 10m, maxLength: 50}"));
    let pool = BrokerPool::new(unique("conn"));
    let broker = broker(&pool, &plan);
    let outcome = converge::converge(&plan, &broker, &[], Mode::Declare).await;
    assert!(outcome.is_ready(), "{outcome:#?}");
    assert_eq!(outcome.settings.reason, Reason::ArgumentsApplied);

    let q = mgmt_get(&format!("queues/%2F/{}", enc(&name))).await.unwrap();
    assert_eq!(
        q["arguments"],
        json!({"x-queue-type": "classic", "x-expires": 600000, "x-max-length": 50, "x-dead-letter-exchange": format!("{name}.dlx"), "x-dead-letter-routing-key": name})
    );
    assert!(
        mgmt_get(&format!("policies/%2F/{}", enc(&plan.policy_name))).await.is_none(),
        "no broker policy in Arguments mode"
    );

    let (_conn, ch) = app().await;
    let durable = QueueDeclareOptions { durable: true, ..Default::default() };
    let err = ch.queue_declare(name.as_str().into(), durable, FieldTable::default()).await.unwrap_err().to_string();
    assert!(err.contains("inequivalent arg") && err.contains("received none but current is"), "{err}");
    remove_all(&plan).await;
}

#[tokio::test]
async fn a_message_rejected_without_requeue_lands_in_the_dead_letter_queue() {
    for settings in ["Policy", "Arguments"] {
        let name = unique("dead-letter");
        let plan = plan_of(&policy(&name, &format!("{{settings: {settings}}}")));
        let pool = BrokerPool::new(unique("conn"));
        let broker = broker(&pool, &plan);
        assert!(converge::converge(&plan, &broker, &[], Mode::Declare).await.is_ready());

        publish(&name, ["poison".to_string()]).await;
        let (_conn, ch) = app().await;
        let got = ch.basic_get(name.as_str().into(), BasicGetOptions::default()).await.unwrap().expect("the message");
        got.delivery.reject(BasicRejectOptions { requeue: false }).await.unwrap();

        let dlq = plan.dead_letter_queue.clone();
        let arrived = eventually(Duration::from_secs(5), || async { counts(&dlq).await == Some((1, 0)) }).await;
        assert!(arrived, "{settings}: the rejected message reaches {dlq}");
        let dead = ch.basic_get(dlq.as_str().into(), BasicGetOptions { no_ack: true }).await.unwrap().unwrap();
        assert_eq!(dead.delivery.data, b"poison");
        let headers = dead.delivery.properties.headers().clone().unwrap();
        let Some(AMQPValue::FieldArray(deaths)) = headers.inner().get("x-death") else {
            panic!("x-death header: {headers:?}")
        };
        let AMQPValue::FieldTable(death) = &deaths.as_slice()[0] else { panic!() };
        assert_eq!(death.inner().get("reason"), Some(&AMQPValue::LongString("rejected".into())));
        remove_all(&plan).await;
    }
}

#[tokio::test]
async fn the_queue_survives_its_last_consumer_while_a_naive_auto_delete_queue_does_not() {
    let name = unique("survives");
    let plan = plan_of(&policy(&name, "{}"));
    let pool = BrokerPool::new(unique("conn"));
    let broker = broker(&pool, &plan);
    assert!(converge::converge(&plan, &broker, &[], Mode::Declare).await.is_ready());

    let naive = unique("naive-auto-delete");
    let (conn, ch) = app().await;
    let auto_delete = QueueDeclareOptions { auto_delete: true, ..Default::default() };
    ch.queue_declare(naive.as_str().into(), auto_delete, FieldTable::default()).await.unwrap();
    publish(&name, ["kept".to_string()]).await;
    publish(&naive, ["lost".to_string()]).await;

    for queue in [&name, &naive] {
        let consumer = ch
            .basic_consume(queue.as_str().into(), "last".into(), BasicConsumeOptions::default(), FieldTable::default())
            .await
            .unwrap();
        drop(consumer);
        ch.basic_cancel("last".into(), BasicCancelOptions::default()).await.unwrap();
    }
    let naive_gone = eventually(Duration::from_secs(5), || async { !exists(&naive).await }).await;
    assert!(naive_gone, "the auto-delete queue is deleted, message and all, the moment its last consumer cancels");
    assert!(exists(&name).await, "the guarded queue stays");
    let _ = conn.close(200, "bye".into()).await;
    assert_eq!(counts(&name).await, Some((1, 0)), "and keeps its message, returned when the consumer's channel closed");
    remove_all(&plan).await;
}

#[tokio::test]
async fn a_conflicting_existing_queue_is_reported_and_left_exactly_as_it_was() {
    let name = unique("conflict");
    let (_conn, ch) = app().await;
    let mut args = FieldTable::default();
    args.insert("x-expires".into(), AMQPValue::LongInt(600_000));
    let durable = QueueDeclareOptions { durable: true, ..Default::default() };
    ch.queue_declare(name.as_str().into(), durable, args).await.unwrap();
    publish(&name, (0..5).map(|i| format!("m{i}"))).await;

    let connection_name = unique("conn");
    let pool = BrokerPool::new(&connection_name);
    for (queue_yaml, received) in [("{}", "unset"), ("{settings: Arguments, expires: 30m}", "\"1800000\"")] {
        let plan = plan_of(&policy(&name, queue_yaml));
        let broker = broker(&pool, &plan);
        let outcome = converge::converge(&plan, &broker, &[], Mode::Declare).await;
        assert_eq!(outcome.queue.status, Truth::False);
        assert_eq!(outcome.queue.reason, Reason::ArgumentsConflict, "{outcome:#?}");
        let msg = &outcome.queue.message;
        assert!(
            msg.contains("argument x-expires is \"600000\" on the broker but this policy declares")
                && msg.contains(received),
            "{msg}"
        );
        assert!(!outcome.is_ready());
        assert_eq!(outcome.settings.reason, Reason::QueueNotDeclared);
    }
    assert_eq!(counts(&name).await, Some((5, 0)), "every message is still there");
    let q = mgmt_get(&format!("queues/%2F/{}", enc(&name))).await.unwrap();
    let mut arguments = q["arguments"].as_object().unwrap().clone();
    // RabbitMQ 4 lists the queue type among the arguments of every queue.
    assert!(arguments.remove("x-queue-type").is_none_or(|t| t == "classic"), "{q}");
    assert_eq!(Value::Object(arguments), json!({"x-expires": 600000}), "the queue was not re-created");

    // The shared connection is still good for other policies.
    let other = plan_of(&policy(&unique("after-conflict"), "{}"));
    let broker = broker(&pool, &other);
    assert!(converge::converge(&other, &broker, &[], Mode::Declare).await.is_ready());
    assert_eq!(pool.connections_opened(), 1);
    // A small frame_max keeps lapin's per-connection buffers small (see broker::amqp::FRAME_MAX).
    let frame_max = || async {
        let all = mgmt_get("connections?columns=client_properties.connection_name,frame_max").await?;
        let mine =
            all.as_array()?.iter().find(|c| c["client_properties"]["connection_name"] == connection_name.as_str())?;
        mine["frame_max"].as_u64()
    };
    assert!(
        eventually(Duration::from_secs(15), || async { frame_max().await.is_some() }).await,
        "the management API never listed connection {connection_name}"
    );
    assert_eq!(frame_max().await, Some(32 * 1024));
    remove_all(&other).await;
    remove_all(&plan_of(&policy(&name, "{}"))).await;
}

#[tokio::test]
async fn a_user_policy_that_shadows_the_operator_is_reported_and_left_alone() {
    let name = unique("shadowed");
    let user_policy = unique("user-policy");
    let body = json!({"pattern": format!("^{}$", regex::escape(&name)), "apply-to": "queues", "priority": 500, "definition": {"max-length": 7}});
    mgmt_put(&format!("policies/%2F/{}", enc(&user_policy)), body).await;
    let before = mgmt_get(&format!("policies/%2F/{}", enc(&user_policy))).await.unwrap();

    let plan = plan_of(&policy(&name, "{}"));
    let pool = BrokerPool::new(unique("conn"));
    let broker = broker(&pool, &plan);
    let outcome = converge::converge(&plan, &broker, &[], Mode::Declare).await;
    assert_eq!(outcome.settings.reason, Reason::PolicyShadowed, "{outcome:#?}");
    assert!(outcome.settings.message.contains(&user_policy) && outcome.settings.message.contains("priority 500"));
    assert!(!outcome.is_ready());
    assert_eq!(
        mgmt_get(&format!("policies/%2F/{}", enc(&user_policy))).await.unwrap(),
        before,
        "the user's policy is untouched"
    );

    mgmt_delete(&format!("policies/%2F/{}", enc(&user_policy))).await;
    assert!(converge::converge(&plan, &broker, &[], Mode::Declare).await.is_ready(), "ready once the shadow is gone");
    remove_all(&plan).await;
}

#[tokio::test]
async fn a_queue_declared_after_the_shared_listing_still_gets_its_unacknowledged_count_on_its_first_pass() {
    let (first, second) = (plan_of(&policy(&unique("listed"), "{}")), plan_of(&policy(&unique("later"), "{}")));
    let pool = BrokerPool::new(unique("conn"));
    let broker = broker(&pool, &first);
    assert!(converge::converge(&first, &broker, &[], Mode::Declare).await.is_ready());
    // The vhost's listing is now cached, read before the second queue existed.
    let outcome = converge::converge(&second, &broker, &[], Mode::Declare).await;
    assert!(outcome.is_ready(), "{outcome:#?}");
    let observed = outcome.queue_observation.expect("observed");
    assert_eq!(
        observed.messages_unacknowledged,
        Some(0),
        "known at once, not at the next renewal (which would cost a status patch then)"
    );
    remove_all(&first).await;
    remove_all(&second).await;
}

#[tokio::test]
async fn passes_at_rest_share_one_read_of_the_vhosts_policies_and_a_lost_policy_is_put_back_within_its_age() {
    let plans: Vec<_> = (0..5).map(|_| plan_of(&policy(&unique("rest"), "{}"))).collect();
    let pool = BrokerPool::new(unique("conn"));
    let brokers: Vec<_> = plans.iter().map(|p| broker(&pool, p)).collect();
    let management = &brokers[0].management;
    assert!(brokers.iter().all(|b| Arc::ptr_eq(b, &brokers[0])), "one endpoint for the vhost");
    let pass = || async {
        let before = management.requests();
        for (plan, broker) in plans.iter().zip(&brokers) {
            let outcome = converge::converge(plan, broker, &[], Mode::Declare).await;
            assert!(outcome.is_ready(), "{outcome:#?}");
            assert_eq!(outcome.settings.reason, Reason::PolicyApplied);
        }
        management.requests() - before
    };
    let cold = pass().await;
    assert!(cold >= 5, "five policies written: {cold} management requests");
    assert_eq!(pass().await, 0, "at rest: the vhost's policies as last read, with our own writes");
    // Someone deletes one. A list younger than LISTING_MAX_AGE still shows it; the first pass
    // on an older one reads the vhost again and puts it back.
    let lost = &plans[2].policy_name;
    mgmt_delete(&format!("policies/%2F/{}", enc(lost))).await;
    tokio::time::sleep(LISTING_MAX_AGE + Duration::from_secs(1)).await;
    let restoring = pass().await;
    assert_eq!(
        restoring, 4,
        "for all five: one read of the vhost's policies, one more before the write, the write, and one queue listing"
    );
    assert!(mgmt_get(&format!("policies/%2F/{}", enc(lost))).await.is_some(), "put back");
    for plan in &plans {
        remove_all(plan).await;
    }
}

#[tokio::test]
async fn changing_a_setting_updates_the_policy_in_place() {
    let name = unique("update");
    let pool = BrokerPool::new(unique("conn"));
    let first = plan_of(&policy(&name, "{expires: 10m}"));
    let broker = broker(&pool, &first);
    assert!(converge::converge(&first, &broker, &[], Mode::Declare).await.is_ready());
    let second = plan_of(&policy(&name, "{expires: 20m, messageTtl: 5m}"));
    assert!(converge::converge(&second, &broker, &[], Mode::Declare).await.is_ready());

    let pol = mgmt_get(&format!("policies/%2F/{}", enc(&first.policy_name))).await.unwrap();
    assert_eq!(pol["definition"]["expires"], json!(1_200_000));
    assert_eq!(pol["definition"]["message-ttl"], json!(300_000));
    let all = mgmt_get("policies/%2F").await.unwrap();
    let ours: Vec<&Value> = all
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["pattern"].as_str().unwrap().contains(&regex::escape(&name)))
        .collect();
    assert_eq!(ours.len(), 1, "one policy, updated, not a second one");
    remove_all(&second).await;
}

#[tokio::test]
async fn bindings_to_missing_exchanges_are_reported_and_removed_bindings_are_unbound() {
    let name = unique("bindings");
    let pool = BrokerPool::new(unique("conn"));
    let missing = plan_of(&policy(
        &name,
        &format!("{{bindings: [{{exchange: {}, routingKey: k}}]}}", unique("no-such-exchange")),
    ));
    let broker = broker(&pool, &missing);
    let outcome = converge::converge(&missing, &broker, &[], Mode::Declare).await;
    assert_eq!(outcome.queue.reason, Reason::ExchangeNotFound, "{outcome:#?}");
    assert!(outcome.queue.message.contains("no exchange"));

    let bound = plan_of(&policy(
        &name,
        "{bindings: [{exchange: amq.direct, routingKey: a}, {exchange: amq.direct, routingKey: b}]}",
    ));
    let first = converge::converge(&bound, &broker, &[], Mode::Declare).await;
    assert!(first.is_ready(), "{first:#?}");
    let applied = first.applied_bindings.unwrap();
    let fewer = plan_of(&policy(&name, "{bindings: [{exchange: amq.direct, routingKey: b}]}"));
    let second = converge::converge(&fewer, &broker, &applied, Mode::Declare).await;
    assert_eq!(second.applied_bindings.as_ref().unwrap().len(), 1);
    let bindings = mgmt_get(&format!("queues/%2F/{}/bindings", enc(&name))).await.unwrap();
    let keys: Vec<&str> = bindings
        .as_array()
        .unwrap()
        .iter()
        .filter(|b| b["source"] == "amq.direct")
        .map(|b| b["routing_key"].as_str().unwrap())
        .collect();
    assert_eq!(keys, ["b"]);
    remove_all(&fewer).await;
}

#[tokio::test]
async fn keep_alive_true_renews_the_expiry_lease() {
    let name = unique("keepalive-on");
    let plan = plan_short(&policy(&name, "{expires: 2s}"));
    let pool = BrokerPool::new(unique("conn"));
    let broker = broker(&pool, &plan);
    for _ in 0..8 {
        let outcome = converge::converge(&plan, &broker, &[], Mode::Declare).await;
        assert!(outcome.is_ready(), "{outcome:#?}");
        tokio::time::sleep(Duration::from_millis(600)).await;
    }
    assert!(exists(&name).await, "declares every 0.6 s keep a 2 s queue alive for 4.8 s");
    remove_all(&plan).await;
}

#[tokio::test]
async fn keep_alive_false_lets_an_unused_queue_expire_on_schedule() {
    let name = unique("keepalive-off");
    let plan = plan_short(&policy(&name, "{expires: 2s, keepAlive: false}"));
    let pool = BrokerPool::new(unique("conn"));
    let broker = broker(&pool, &plan);
    assert!(converge::converge(&plan, &broker, &[], Mode::Declare).await.is_ready());
    let mut last = None;
    for _ in 0..8 {
        tokio::time::sleep(Duration::from_millis(600)).await;
        last = Some(converge::converge(&plan, &broker, &[], Mode::Inspect).await);
    }
    assert!(!exists(&name).await, "observing through the management API does not renew the lease");
    let last = last.unwrap();
    assert_eq!(last.queue.reason, Reason::QueueNotFound, "{last:#?}");
    assert!(last.queue.message.contains("keepAlive is false"));
    remove_all(&plan).await;
}

#[tokio::test]
async fn delete_policy_removes_only_an_empty_unused_queue() {
    let name = unique("delete");
    let plan = plan_of(&policy_doc(&name, "queue: {}\n  deletionPolicy: Delete"));
    let pool = BrokerPool::new(unique("conn"));
    let broker = broker(&pool, &plan);
    assert!(converge::converge(&plan, &broker, &[], Mode::Declare).await.is_ready());
    publish(&name, ["keep me".to_string()]).await;

    let Cleanup::Blocked(check) = converge::delete(&plan, &broker, &Claims::default()).await else {
        panic!("a queue with a message must not be deleted")
    };
    assert_eq!(check.reason, Reason::DeletionBlocked);
    assert!(check.message.contains(&name), "{}", check.message);
    assert_eq!(counts(&name).await, Some((1, 0)));

    let (_conn, ch) = app().await;
    let got = ch.basic_get(name.as_str().into(), BasicGetOptions { no_ack: true }).await.unwrap();
    assert!(got.is_some());
    assert!(matches!(converge::delete(&plan, &broker, &Claims::default()).await, Cleanup::Deleted(_)));
    assert!(!exists(&name).await && !exists(&plan.dead_letter_queue).await);
    assert!(mgmt_get(&format!("policies/%2F/{}", enc(&plan.policy_name))).await.is_none());
}

/// Two policies dead-lettering into one exchange and queue: deleting one (deletionPolicy
/// Delete, everything empty) leaves both to the other, whose rejected message still lands.
#[tokio::test]
async fn deleting_a_policy_keeps_the_dead_letter_queue_and_exchange_another_policy_names() {
    let (dlx, dead) = (unique("shared-dlx"), unique("shared-dead"));
    let shared = format!("queue: {{deadLetter: {{exchange: {dlx}, queue: {dead}}}}}\n  deletionPolicy: Delete");
    let (a, b) = (policy_doc(&unique("share-a"), &shared), policy_doc(&unique("share-b"), &shared));
    let (plan_a, plan_b) = (plan_of(&a), plan_of(&b));
    let pool = BrokerPool::new(unique("conn"));
    for plan in [&plan_a, &plan_b] {
        assert!(converge::converge(plan, &broker(&pool, plan), &[], Mode::Declare).await.is_ready());
    }

    let claims =
        queueguard::claims::others(&a, &plan_a, &[a.clone(), b.clone()], &[] as &[QueuePattern], Default::default());
    let Cleanup::Deleted(note) = converge::delete(&plan_a, &broker(&pool, &plan_a), &claims).await else {
        panic!("an empty, unused queue is deleted")
    };
    assert!(!exists(&plan_a.queue).await, "its own queue goes");
    assert!(exists(&dead).await, "the shared dead-letter queue stays");
    assert!(
        note.contains(&format!("kept dead-letter queue '{dead}'")) && note.contains(&b.metadata.name.clone().unwrap()),
        "{note}"
    );
    assert!(mgmt_get(&format!("exchanges/%2F/{}", enc(&dlx))).await.is_some(), "the shared exchange stays: {note}");

    // The other policy's dead letters still arrive.
    publish(&plan_b.queue, ["poison".to_string()]).await;
    let (_conn, ch) = app().await;
    let got = ch.basic_get(plan_b.queue.as_str().into(), BasicGetOptions::default()).await.unwrap().unwrap();
    got.delivery.reject(BasicRejectOptions { requeue: false }).await.unwrap();
    assert!(eventually(Duration::from_secs(5), || async { counts(&dead).await == Some((1, 0)) }).await);
    remove_all(&plan_b).await;
    remove_all(&plan_a).await;
}

/// A broker policy written into a vhost that does not exist is an error (the API answers 404),
/// never taken as written; a dot-segment vhost is refused before any request.
#[tokio::test]
async fn a_policy_write_the_broker_cannot_place_is_an_error() {
    let plan = plan_of(&policy(&unique("no-vhost"), "{}"));
    let pool = BrokerPool::new(unique("conn"));
    let broker = broker(&pool, &plan);
    let policy = queueguard::broker::management::PolicyInfo {
        name: unique("p"),
        pattern: "^x$".into(),
        apply_to: "queues".into(),
        priority: 1,
        definition: serde_json::Map::from_iter([("expires".to_owned(), json!(60_000))]),
    };
    let missing = unique("missing-vhost");
    let e = broker.management.put_policy(&missing, &policy).await.expect_err("no such vhost");
    assert!(e.to_string().contains("404"), "{e}");
    for dot in [".", ".."] {
        let e = broker.management.put_policy(dot, &policy).await.expect_err("a dot segment");
        assert!(e.to_string().contains("dot segment"), "{e}");
    }
    assert!(mgmt_get(&format!("policies/%2F/{}", enc(&policy.name))).await.is_none(), "nothing landed elsewhere");
}

/// spec.queue.deliveryLimit reaches a quorum queue through the operator's policy: a poison
/// message requeued that often is dead-lettered, not redelivered for ever (and status says
/// which limit is in effect).
#[tokio::test]
async fn a_quorum_queues_delivery_limit_dead_letters_a_poison_message() {
    let name = unique("delivery-limit");
    let plan = plan_of(&policy(&name, "{type: quorum, deliveryLimit: 2}"));
    let pool = BrokerPool::new(unique("conn"));
    let outcome = converge::converge(&plan, &broker(&pool, &plan), &[], Mode::Declare).await;
    assert!(outcome.is_ready(), "{outcome:#?}");
    assert!(outcome.settings.message.contains("delivery limit 2"), "{}", outcome.settings.message);
    let applied = mgmt_get(&format!("policies/%2F/{}", enc(&plan.policy_name))).await.unwrap();
    assert_eq!(applied["definition"]["delivery-limit"], 2);
    publish(&name, ["poison".to_string()]).await;
    let (_conn, ch) = app().await;
    let requeued = std::sync::atomic::AtomicU32::new(0);
    // The policy reaches the queue within the broker's policy propagation; then the third
    // delivery is refused and the message goes to the dead-letter queue.
    let dead_lettered = eventually(Duration::from_secs(15), || async {
        if let Ok(Some(got)) = ch.basic_get(name.as_str().into(), BasicGetOptions::default()).await {
            requeued.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            got.delivery.nack(lapin::options::BasicNackOptions { requeue: true, ..Default::default() }).await.unwrap();
        }
        counts(&format!("{name}.dlq")).await == Some((1, 0))
    });
    assert!(dead_lettered.await, "the poison message never reached the dead-letter queue");
    let requeued = requeued.into_inner();
    eprintln!("dead-lettered after {requeued} requeues");
    assert!(requeued <= 4, "not redelivered for ever: {requeued}");
    remove_all(&plan).await;
}

#[tokio::test]
async fn every_policy_on_a_broker_shares_one_connection() {
    let pool = BrokerPool::new(unique("shared-conn"));
    let plans: Vec<_> = (0..5).map(|i| plan_of(&policy(&unique(&format!("shared{i}")), "{}"))).collect();
    let mut handles = Vec::new();
    for plan in plans.clone() {
        let broker = broker(&pool, &plan);
        handles
            .push(tokio::spawn(async move { converge::converge(&plan, &broker, &[], Mode::Declare).await.is_ready() }));
    }
    for h in handles {
        assert!(h.await.unwrap());
    }
    assert_eq!(pool.connections_opened(), 1);
    for plan in &plans {
        remove_all(plan).await;
    }
}

#[tokio::test]
async fn counts_come_from_the_declare() {
    let name = unique("counts");
    let plan = plan_of(&policy(&name, "{}"));
    let pool = BrokerPool::new(unique("conn"));
    let broker = broker(&pool, &plan);
    assert!(converge::converge(&plan, &broker, &[], Mode::Declare).await.is_ready());
    publish(&name, (0..3).map(|i| i.to_string())).await;
    let (_conn, ch) = app().await;
    ch.basic_qos(1, Default::default()).await.unwrap();
    let mut consumer = ch
        .basic_consume(name.as_str().into(), "c".into(), BasicConsumeOptions::default(), FieldTable::default())
        .await
        .unwrap();
    let _held = consumer.next().await; // one delivered, not acknowledged
    let outcome = converge::converge(&plan, &broker, &[], Mode::Declare).await;
    let q = outcome.queue_observation.unwrap();
    assert_eq!((q.messages_ready, q.consumers), (Some(2), Some(1)));
    assert_eq!(outcome.dead_letter_observation.unwrap().messages_ready, Some(0));
    drop(consumer);
    drop(ch);
    remove_all(&plan).await;
}

/// Quorum queues refuse `queue.delete` with if-unused/if-empty, and with a connection-level
/// close (540) at that: deletion establishes "empty and unused" first and deletes without the
/// flags. Not empty, not unused, or holding unacknowledged messages: blocked; and the shared
/// connection is never closed.
#[tokio::test]
async fn a_quorum_queue_is_deleted_only_when_empty_and_unused_without_closing_the_connection() {
    let name = unique("quorum-delete");
    let plan = plan_of(&policy_doc(&name, "queue: {type: quorum}\n  deletionPolicy: Delete"));
    let pool = BrokerPool::new(unique("conn"));
    let broker = broker(&pool, &plan);
    assert!(converge::converge(&plan, &broker, &[], Mode::Declare).await.is_ready());

    publish(&name, ["keep me".to_string()]).await;
    let blocked = |c: Cleanup| match c {
        Cleanup::Blocked(check) => check,
        other => panic!("expected blocked, got {other:?}"),
    };
    let check = blocked(converge::delete(&plan, &broker, &Claims::default()).await);
    assert_eq!(check.reason, Reason::DeletionBlocked);
    assert!(check.message.contains("1 ready messages"), "{}", check.message);

    // The message delivered and held, not acknowledged: still not deletable. The management
    // API shows the unacknowledged count after its statistics interval.
    let (_conn, ch) = app().await;
    ch.basic_qos(1, Default::default()).await.unwrap();
    let mut consumer = ch
        .basic_consume(name.as_str().into(), "holder".into(), BasicConsumeOptions::default(), FieldTable::default())
        .await
        .unwrap();
    let delivery = consumer.next().await.unwrap().unwrap();
    let check = blocked(converge::delete(&plan, &broker, &Claims::default()).await);
    assert!(check.message.contains("1 consumers"), "a consumer is attached: {}", check.message);
    ch.basic_cancel("holder".into(), Default::default()).await.unwrap();
    let unacked_seen = eventually(Duration::from_secs(15), || async {
        mgmt_get(&format!("queues/%2F/{}", enc(&name))).await.is_some_and(|q| q["messages_unacknowledged"] == 1)
    });
    assert!(unacked_seen.await);
    let check = blocked(converge::delete(&plan, &broker, &Claims::default()).await);
    assert!(check.message.contains("1 unacknowledged"), "{}", check.message);
    delivery.ack(Default::default()).await.unwrap();
    drop(consumer);
    drop(ch);

    let deleted = eventually(Duration::from_secs(15), || async {
        matches!(converge::delete(&plan, &broker, &Claims::default()).await, Cleanup::Deleted(_))
    });
    assert!(deleted.await, "empty and unused once the ack is in the statistics");
    assert!(!exists(&name).await && !exists(&plan.dead_letter_queue).await);
    assert_eq!(pool.connections_opened(), 1, "the shared connection was never closed");
    assert!(broker.amqp.is_connected());
}

/// A connection-level close in the middle of a burst of reconciles (here the broker's own 540,
/// provoked on the shared connection) fails no other policy: each converge that lost its
/// connection goes through its steps once more on a fresh one and ends Ready.
#[tokio::test]
async fn a_connection_closed_under_a_burst_of_converges_fails_none_of_them() {
    let pool = Arc::new(BrokerPool::new(unique("burst-conn")));
    let plans: Vec<_> = (0..24).map(|i| plan_of(&policy(&unique(&format!("burst{i}")), "{}"))).collect();
    let victim = unique("burst-quorum");
    let quorum = plan_of(&policy(&victim, "{type: quorum}"));
    let broker = broker(&pool, &quorum);
    assert!(converge::converge(&quorum, &broker, &[], Mode::Declare).await.is_ready());
    let trackers = TrackerPool::new(&unique("burst-conn"));
    let tracker = trackers.tracker(&broker.uri, None).unwrap();
    let events_live = eventually(Duration::from_secs(10), || async {
        tracker.tracking("/") == queueguard::consumers::Tracking::Events
    });
    assert!(events_live.await);
    let mut handles = Vec::new();
    for (i, plan) in plans.clone().into_iter().enumerate() {
        let broker = broker.clone();
        let victim = victim.clone();
        handles.push(tokio::spawn(async move {
            if i == 8 {
                // What the broker does to a quorum queue deleted with if-unused: closes the
                // whole connection (540 NOT_IMPLEMENTED).
                let ch = broker.amqp.channel().await.unwrap();
                let flags = lapin::options::QueueDeleteOptions { if_unused: true, ..Default::default() };
                let refused = ch.queue_delete(victim.as_str().into(), flags).await;
                assert!(refused.is_err(), "the broker refuses it");
            }
            converge::converge(&plan, &broker, &[], Mode::Declare).await
        }));
    }
    for h in handles {
        let outcome = h.await.unwrap();
        assert!(outcome.is_ready(), "{:?}", outcome.ready());
    }
    assert!(broker.amqp.connections_opened() >= 2, "the connection was closed and opened again");
    assert_eq!(tracker.broker().amqp.connections_opened(), 1, "the event subscription has its own connection");
    assert_eq!(tracker.tracking("/"), queueguard::consumers::Tracking::Events);
    for plan in plans.iter().chain([&quorum]) {
        remove_all(plan).await;
    }
}

/// A Secret whose password a secret manager rotates 20 times: each rotation's endpoint and
/// tracker replace the last, whose connections close once swept, so the broker sees the same
/// two connections (declarations and events) after every rotation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_credential_rotations_leave_the_connection_count_constant() {
    let user = unique("rotate-user");
    let set_password = |password: String| {
        let user = user.clone();
        async move {
            mgmt_put(&format!("users/{}", enc(&user)), json!({"password": password, "tags": "administrator"})).await
        }
    };
    set_password("p0".into()).await;
    let everything = json!({"configure": ".*", "write": ".*", "read": ".*"});
    mgmt_put(&format!("permissions/%2F/{}", enc(&user)), everything).await;
    let pool = BrokerPool::new(unique("rotate-conn"));
    let trackers = TrackerPool::new(&unique("rotate-conn"));
    let plan = plan_of(&policy(&unique("rotate"), "{}"));
    let mut counts = Vec::new();
    for round in 1..=20 {
        let password = format!("p{round}");
        set_password(password.clone()).await;
        let uri = format!("amqp://{}:{password}@{}/%2F", enc(&user), broker_addr());
        let creds = BrokerCredentials {
            uri,
            management_uri: Some(management_base()),
            ca_cert: None,
            addresses: None,
            prometheus_uri: None,
        };
        let rotated_at = Instant::now();
        let broker = queueguard::pass::broker_for_plan(&pool, &plan, &creds).unwrap();
        assert!(converge::converge(&plan, &broker, &[], Mode::Declare).await.is_ready(), "round {round}");
        let tracker = trackers.tracker(&broker.uri, None).unwrap();
        let events = eventually(Duration::from_secs(10), || async {
            tracker.tracking("/") == queueguard::consumers::Tracking::Events
        });
        assert!(events.await, "round {round}: {}", tracker.tracking("/"));
        drop((broker, tracker));
        // What the controller's sweep (every 10 s) does after the last reconcile on the old
        // Secret, repeated as it is: a sweep keeps a tracker its own resync holds at that instant.
        // The management API lists a closed connection until its next statistics round, hence
        // rabbitmqctl; a swept tracker's event subscription ends with it, events or none.
        let swept = || async {
            pool.sweep(rotated_at);
            trackers.sweep(rotated_at);
            connections_of(&user) == 2
        };
        eventually(Duration::from_secs(15), swept).await;
        counts.push(connections_of(&user));
    }
    assert_eq!(counts, vec![2; 20], "connections of the rotated user after each rotation");
    let states = [pool.connection_states(), trackers.connection_states()];
    assert_eq!(states.each_ref().map(Vec::len), [1, 1], "one declarations and one events series: {states:?}");
    assert!(states.iter().flatten().all(|(_, up)| *up), "{states:?}");
    drop((pool, trackers));
    assert!(eventually(Duration::from_secs(5), || async { connections_of(&user) == 0 }).await);
    remove_all(&plan).await;
    mgmt_delete(&format!("users/{}", enc(&user))).await;
}

/// The broker's own count of `user`'s connections (rabbitmqctl: the management API lists a new
/// connection only after its statistics interval).
fn connections_of(user: &str) -> usize {
    let out = rabbitmqctl(&["list_connections", "-q", "user"]);
    assert!(out.status.success(), "rabbitmqctl list_connections");
    String::from_utf8_lossy(&out.stdout).lines().filter(|l| l.trim() == user).count()
}
