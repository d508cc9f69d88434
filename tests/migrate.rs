//! Live migrations of a queue to a new shape, against the real broker (RabbitMQ 3.10 here, 4.0
//! in the suite's second run): nothing lost while publishers and consumers keep going, every
//! header kept, a migration stopped at any step resumed, a refused one touching nothing.

mod common;

use common::{
    app, broker, counts, delete_queues, enc, mgmt_get, plan_of, policy_doc, remove_all,
    traffic::{Route, Traffic},
    unique,
};
use lapin::{
    BasicProperties, ExchangeKind,
    options::{BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions},
    types::{AMQPValue, FieldTable},
};
use queueguard::{
    broker::{Broker, BrokerPool},
    converge::{self, Mode},
    crd::{MigrationPhase, MigrationStatus},
    migrate::{
        self, Bounds, Target,
        run::{Ended, Journal, migrate},
    },
    plan::QueuePlan,
};
use std::{collections::BTreeMap, sync::Arc, time::Duration};

/// Records each step; fails the record of `stop_at` (as an operator killed right then); at the
/// record of `pause_at`'s step, tells the test and waits for its word (something happens to
/// the broker between two steps).
#[derive(Default)]
struct Recorder {
    phases: Vec<MigrationPhase>,
    /// When each step was recorded (just before it was taken).
    at: Vec<std::time::Instant>,
    last: Option<MigrationStatus>,
    stop_at: Option<MigrationPhase>,
    pause_at: Option<(MigrationPhase, tokio::sync::oneshot::Sender<()>, tokio::sync::oneshot::Receiver<()>)>,
}

impl Recorder {
    /// A recorder that pauses at `phase`; the test gets told it paused, and says go on.
    fn pausing_at(
        phase: MigrationPhase,
    ) -> (Self, tokio::sync::oneshot::Receiver<()>, tokio::sync::oneshot::Sender<()>) {
        let (paused, told) = tokio::sync::oneshot::channel();
        let (go, going) = tokio::sync::oneshot::channel();
        (Self { pause_at: Some((phase, paused, going)), ..Self::default() }, told, go)
    }
}

impl Journal for Recorder {
    async fn record(&mut self, state: &MigrationStatus) -> Result<(), String> {
        if self.stop_at == Some(state.phase) {
            self.stop_at = None;
            return Err("stopped by the test".into());
        }
        if self.pause_at.as_ref().is_some_and(|(p, _, _)| *p == state.phase) {
            let (_, paused, going) = self.pause_at.take().unwrap();
            paused.send(()).unwrap();
            going.await.unwrap();
        }
        self.phases.push(state.phase);
        self.at.push(std::time::Instant::now());
        self.last = Some(state.clone());
        Ok(())
    }
}

/// A policy's queue declared as it is, and the plan of the same policy with `change` applied.
async fn declared(name: &str, queue: &str, changed: &str) -> (QueuePlan, QueuePlan, Arc<Broker>) {
    let before = plan_of(&policy_doc(name, &format!("queue: {queue}")));
    let after = plan_of(&policy_doc(name, &format!("queue: {changed}")));
    let pool = Box::leak(Box::new(BrokerPool::new("qgt-migrate")));
    let b = broker(pool, &before);
    assert!(converge::converge(&before, &b, &[], Mode::Declare).await.is_ready());
    (before, after, b)
}

async fn exchange_bound_to(queue: &str) -> String {
    let exchange = unique("migrate-x");
    let (_conn, ch) = app().await;
    ch.exchange_declare(
        exchange.as_str().into(),
        ExchangeKind::Direct,
        ExchangeDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch.queue_bind(
        queue.into(),
        exchange.as_str().into(),
        "work".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    exchange
}

async fn queue_type(queue: &str) -> String {
    let q = mgmt_get(&format!("queues/%2F/{}", enc(queue))).await.expect("queue exists");
    q["type"].as_str().unwrap_or("classic").to_owned()
}

async fn exchange_sources(queue: &str) -> Vec<(String, String)> {
    let list = mgmt_get(&format!("queues/%2F/{}/bindings", enc(queue))).await.unwrap_or_default();
    let mut sources: Vec<(String, String)> = list
        .as_array()
        .unwrap()
        .iter()
        .filter(|b| b["source"] != "")
        .map(|b| (b["source"].as_str().unwrap().to_owned(), b["routing_key"].as_str().unwrap().to_owned()))
        .collect();
    sources.sort();
    sources
}

async fn preload(queue: &str, ids: &[String]) {
    let (_conn, ch) = app().await;
    ch.confirm_select(ConfirmSelectOptions::default()).await.unwrap();
    for id in ids {
        ch.basic_publish(
            "".into(),
            queue.into(),
            BasicPublishOptions::default(),
            id.as_bytes(),
            BasicProperties::default().with_delivery_mode(2).with_message_id(id.as_str().into()),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    }
}

fn moved(ended: Ended) -> MigrationStatus {
    match ended {
        Ended::Moved(state) => *state,
        Ended::NotNeeded => panic!("the migration had nothing to do"),
    }
}

#[tokio::test]
async fn classic_to_quorum_under_live_traffic_loses_nothing() {
    let name = unique("migrate-live");
    let (before, after, b) = declared(&name, "{type: classic}", "{type: quorum, onChange: Migrate}").await;
    let queue = before.queue.clone();
    let exchange = exchange_bound_to(&queue).await;
    let preloaded: Vec<String> = (0..2000).map(|i| format!("P-{i}")).collect();
    preload(&queue, &preloaded).await;

    let routes = [
        Route { exchange: exchange.clone(), routing_key: "work".into(), tag: "X", stop_after: None },
        // Publishers through the default exchange that pause: the swap waits for it.
        Route {
            exchange: String::new(),
            routing_key: queue.clone(),
            tag: "D",
            stop_after: Some(Duration::from_secs(2)),
        },
        Route {
            exchange: String::new(),
            routing_key: queue.clone(),
            tag: "E",
            stop_after: Some(Duration::from_secs(2)),
        },
    ];
    let mut traffic =
        Traffic::start(&common::broker_uri(), &queue, &routes, 2, Duration::from_millis(2), preloaded).await;
    tokio::time::sleep(Duration::from_millis(300)).await;

    let mut journal = Recorder::default();
    let target = Target::of_queue(&after);
    let bounds = Bounds::default();
    let migrating = migrate(&b, &target, None, &mut journal, &bounds);
    let ended = tokio::time::timeout(Duration::from_secs(60), migrating).await;
    let state = moved(ended.unwrap_or_else(|_| panic!("the migration hung after {:?}", journal.phases)).unwrap());
    let restart = tokio::time::timeout(Duration::from_secs(30), traffic.restart_consumers()).await;
    assert!(restart.is_ok(), "the consumers stopped");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let tally = traffic.finish(Duration::from_secs(15)).await;

    println!(
        "published {} consumed {} lost {} duplicates {} returned {} refused {} | moved out {} back {} | swap window {:?} ms, fenced {:?} ms",
        tally.published,
        tally.consumed,
        tally.lost.len(),
        tally.duplicates,
        tally.returned,
        tally.refused,
        state.moved_out,
        state.moved_back,
        state.swap_window_millis,
        state.fenced_millis,
    );
    assert!(tally.lost.is_empty(), "confirmed and never consumed: {:?}", &tally.lost[..tally.lost.len().min(10)]);
    assert_eq!(tally.consumed + tally.lost.len(), tally.published);
    assert!(tally.published > 2000, "the publishers ran throughout");
    assert_eq!(
        journal.phases,
        [
            MigrationPhase::Preparing,
            MigrationPhase::Draining,
            MigrationPhase::Swapping,
            MigrationPhase::Restoring,
            MigrationPhase::Refilling,
            MigrationPhase::RestartingConsumers
        ]
    );
    assert_eq!(state.phase, MigrationPhase::RestartingConsumers);
    assert_eq!(state.dropped_at_swap, Some(0));
    assert!(state.swap_window_millis.is_some());
    assert_eq!(queue_type(&queue).await, "quorum");
    assert_eq!(exchange_sources(&queue).await, [(exchange.clone(), "work".to_owned())]);
    assert_eq!(counts(&state.holding_queue).await, None, "the holding queue is gone");
    assert!(state.from.starts_with("classic") && state.to.starts_with("quorum"), "{state:?}");
    remove_all(&after).await;
}

/// Each header, property and priority as published.
fn properties_of(i: usize) -> BasicProperties {
    let mut death = BTreeMap::new();
    death.insert("queue".into(), AMQPValue::LongString("orders".into()));
    death.insert("count".into(), AMQPValue::LongLongInt(i as i64 % 3));
    let mut headers = BTreeMap::new();
    headers.insert("n".into(), AMQPValue::LongLongInt(i as i64));
    headers.insert("x-death".into(), AMQPValue::FieldArray(vec![AMQPValue::FieldTable(death.into())].into()));
    BasicProperties::default()
        .with_delivery_mode(2)
        .with_message_id(format!("m-{i}").into())
        .with_timestamp(1_700_000_000 + i as u64)
        .with_priority((i % 10) as u8)
        .with_content_type("application/json".into())
        .with_correlation_id(format!("c-{i}").into())
        .with_headers(headers.into())
}

/// A message's properties without the delivery count a quorum queue adds when it delivers.
fn as_published(delivered: &BasicProperties) -> BasicProperties {
    let mut headers = FieldTable::default();
    for (k, v) in delivered.headers().as_ref().map(|h| h.inner().clone()).unwrap_or_default() {
        if k.as_str() != "x-delivery-count" {
            headers.insert(k, v);
        }
    }
    delivered.clone().with_headers(headers)
}

#[tokio::test]
async fn ten_thousand_queued_messages_keep_every_header_and_property() {
    let name = unique("migrate-headers");
    let (before, after, b) = declared(&name, "{type: classic}", "{type: quorum, onChange: Migrate}").await;
    let queue = before.queue.clone();
    {
        let (_conn, ch) = app().await;
        ch.confirm_select(ConfirmSelectOptions::default()).await.unwrap();
        let mut confirms = Vec::new();
        for i in 0..10_000 {
            let body = format!("{{\"n\":{i}}}");
            confirms.push(
                ch.basic_publish(
                    "".into(),
                    queue.as_str().into(),
                    BasicPublishOptions::default(),
                    body.as_bytes(),
                    properties_of(i),
                )
                .await
                .unwrap(),
            );
        }
        for c in confirms {
            assert!(c.await.unwrap().is_ack());
        }
    }
    let state = moved(
        migrate(&b, &Target::of_queue(&after), None, &mut Recorder::default(), &Bounds::default()).await.unwrap(),
    );
    assert_eq!((state.moved_out, state.moved_back), (10_000, 10_000));
    assert_eq!(queue_type(&queue).await, "quorum");

    let (_conn, ch) = app().await;
    let mut seen = vec![false; 10_000];
    while let Some(m) = ch.basic_get(queue.as_str().into(), BasicGetOptions { no_ack: true }).await.unwrap() {
        let body: serde_json::Value = serde_json::from_slice(&m.delivery.data).unwrap();
        let i = body["n"].as_u64().unwrap() as usize;
        assert_eq!(as_published(&m.delivery.properties), properties_of(i), "message {i}");
        assert!(!seen[i], "message {i} twice");
        seen[i] = true;
    }
    assert!(seen.iter().all(|s| *s), "every message arrived");
    remove_all(&after).await;
}

#[tokio::test]
async fn a_migration_stopped_before_any_step_resumes_and_loses_nothing() {
    for stop_at in [
        MigrationPhase::Preparing,
        MigrationPhase::Draining,
        MigrationPhase::Swapping,
        MigrationPhase::Restoring,
        MigrationPhase::Refilling,
        MigrationPhase::RestartingConsumers,
    ] {
        let name = unique("migrate-stop");
        let (before, after, b) = declared(&name, "{type: classic}", "{type: quorum, onChange: Migrate}").await;
        let queue = before.queue.clone();
        let exchange = exchange_bound_to(&queue).await;
        let ids: Vec<String> = (0..500).map(|i| format!("S-{i}")).collect();
        preload(&queue, &ids).await;
        let target = Target::of_queue(&after);

        let mut first = Recorder { stop_at: Some(stop_at), ..Default::default() };
        let stopped = migrate(&b, &target, None, &mut first, &Bounds::default()).await;
        assert!(matches!(stopped, Err(migrate::Error::NotRecorded { .. })), "{stop_at:?}: {stopped:?}");
        if stop_at == MigrationPhase::RestartingConsumers {
            // Issue 31, 9: recorded before the holding queue goes, or nothing would say that
            // the consumers are still to be restarted.
            assert!(counts(&migrate::holding_name(&queue)).await.is_some(), "the holding queue waits for the record");
        }
        let mut second = Recorder::default();
        let state = moved(migrate(&b, &target, first.last.as_ref(), &mut second, &Bounds::default()).await.unwrap());

        // Each step is recorded before it is taken: the last one recorded may not have finished.
        let recorded = first.last.as_ref().map_or(MigrationPhase::Preparing, |s| s.phase);
        // ...or the broker shows that it did, and the next one is where to go on.
        let resumed = second.phases.first().copied();
        assert!(
            resumed.is_some_and(|r| recorded <= r && r <= stop_at),
            "{stop_at:?}: resumed at {resumed:?}, not between the last step recorded ({recorded:?}) and the one stopped"
        );
        assert_eq!(queue_type(&queue).await, "quorum", "{stop_at:?}");
        assert_eq!(exchange_sources(&queue).await, [(exchange.clone(), "work".to_owned())], "{stop_at:?}");
        assert_eq!(counts(&state.holding_queue).await, None, "{stop_at:?}");
        let traffic = Traffic::start(&common::broker_uri(), &queue, &[], 1, Duration::ZERO, ids).await;
        let tally = traffic.finish(Duration::from_secs(20)).await;
        assert!(tally.lost.is_empty(), "{stop_at:?}: lost {:?}", tally.lost);
        assert_eq!(tally.duplicates, 0, "{stop_at:?}: a stop between steps moves nothing twice");
        remove_all(&after).await;
    }
}

#[tokio::test]
async fn a_migration_cut_off_while_moving_resumes_with_nothing_lost() {
    let name = unique("migrate-cut");
    let (before, after, b) = declared(&name, "{type: classic}", "{type: quorum, onChange: Migrate}").await;
    let queue = before.queue.clone();
    let ids: Vec<String> = (0..20_000).map(|i| format!("C-{i}")).collect();
    preload(&queue, &ids).await;
    let target = Target::of_queue(&after);

    let mut first = Recorder::default();
    let cut =
        tokio::time::timeout(Duration::from_millis(400), migrate(&b, &target, None, &mut first, &Bounds::default()))
            .await;
    assert!(cut.is_err(), "the migration was still moving when it was cut off");
    assert_eq!(first.last.as_ref().map(|s| s.phase), Some(MigrationPhase::Draining));
    let state =
        moved(migrate(&b, &target, first.last.as_ref(), &mut Recorder::default(), &Bounds::default()).await.unwrap());
    assert_eq!(queue_type(&queue).await, "quorum");
    let traffic = Traffic::start(&common::broker_uri(), &queue, &[], 2, Duration::ZERO, ids).await;
    let tally = traffic.finish(Duration::from_secs(30)).await;
    println!(
        "cut off mid-move: duplicates {} (moved out {} back {})",
        tally.duplicates, state.moved_out, state.moved_back
    );
    assert!(tally.lost.is_empty(), "lost {}", tally.lost.len());
    remove_all(&after).await;
}

#[tokio::test]
async fn quorum_to_classic_and_back_to_where_it_was() {
    let name = unique("migrate-back");
    let (before, after, b) = declared(&name, "{type: quorum}", "{type: classic, onChange: Migrate}").await;
    let queue = before.queue.clone();
    let ids: Vec<String> = (0..300).map(|i| format!("Q-{i}")).collect();
    preload(&queue, &ids).await;
    let state = moved(
        migrate(&b, &Target::of_queue(&after), None, &mut Recorder::default(), &Bounds::default()).await.unwrap(),
    );
    assert_eq!(queue_type(&queue).await, "classic");
    assert_eq!(state.dropped_at_swap, Some(0));
    assert_eq!(counts(&queue).await.map(|(ready, _)| ready), Some(300));
    // Nothing to do once there.
    let again = migrate(&b, &Target::of_queue(&after), Some(&state), &mut Recorder::default(), &Bounds::default())
        .await
        .unwrap();
    assert_eq!(again, Ended::NotNeeded);
    remove_all(&after).await;
    remove_all(&before).await;
}

#[tokio::test]
async fn an_arguments_mode_change_of_max_length_moves_the_queue() {
    let name = unique("migrate-args");
    let (before, after, b) = declared(
        &name,
        "{settings: Arguments, maxLength: 1000}",
        "{settings: Arguments, maxLength: 2000, onChange: Migrate}",
    )
    .await;
    let queue = before.queue.clone();
    let ids: Vec<String> = (0..800).map(|i| format!("A-{i}")).collect();
    preload(&queue, &ids).await;
    let state = moved(
        migrate(&b, &Target::of_queue(&after), None, &mut Recorder::default(), &Bounds::default()).await.unwrap(),
    );
    let q = mgmt_get(&format!("queues/%2F/{}", enc(&queue))).await.unwrap();
    assert_eq!(q["arguments"]["x-max-length"], 2000);
    assert_eq!(counts(&queue).await.map(|(ready, _)| ready), Some(800));
    assert!(state.from.contains("x-max-length: 1000") && state.to.contains("x-max-length: 2000"), "{state:?}");
    // The policy's own converge now finds the queue as it declares it.
    assert!(converge::converge(&after, &b, &[], Mode::Declare).await.is_ready());
    remove_all(&after).await;
}

#[tokio::test]
async fn a_refused_change_touches_nothing() {
    let name = unique("migrate-refused");
    let before = plan_of(&policy_doc(&name, "queue: {type: classic}"));
    let after = plan_of(&policy_doc(&name, "queue: {type: quorum, onChange: Migrate}"));
    let pool = BrokerPool::new("qgt-migrate");
    let b = broker(&pool, &before);
    // A priority queue, as an application declared it.
    let (_conn, ch) = app().await;
    let mut args = FieldTable::default();
    args.insert("x-max-priority".into(), AMQPValue::LongLongInt(5));
    ch.queue_declare(
        before.queue.as_str().into(),
        lapin::options::QueueDeclareOptions { durable: true, ..Default::default() },
        args,
    )
    .await
    .unwrap();
    preload(&before.queue, &["r-1".into(), "r-2".into()]).await;
    let bindings_before = exchange_sources(&before.queue).await;

    let mut journal = Recorder::default();
    let refused = migrate(&b, &Target::of_queue(&after), None, &mut journal, &Bounds::default()).await;
    let Err(migrate::Error::Refused(why)) = refused else { panic!("not refused: {refused:?}") };
    assert!(why.contains("priority queue (x-max-priority 5)"), "{why}");
    assert!(journal.phases.is_empty(), "no step was taken");
    assert_eq!(queue_type(&before.queue).await, "classic");
    assert_eq!(counts(&before.queue).await.map(|(ready, _)| ready), Some(2));
    assert_eq!(counts(&migrate::holding_name(&before.queue)).await, None, "no holding queue");
    assert_eq!(exchange_sources(&before.queue).await, bindings_before);
    remove_all(&before).await;
}

/// The fences of `queue` on the broker, of any attempt.
async fn fences_of(queue: &str) -> Vec<String> {
    let policies: Vec<queueguard::broker::management::PolicyInfo> =
        serde_json::from_value(mgmt_get("policies/%2F").await.unwrap()).unwrap();
    policies.into_iter().filter(|p| migrate::is_fence_of(p, queue)).map(|p| p.name).collect()
}

/// Every message in a queue, taken off it: ids (message-id, else the body) and how often each.
async fn take_all(queue: &str) -> BTreeMap<String, u32> {
    let (_conn, ch) = app().await;
    let mut seen = BTreeMap::new();
    while let Some(m) = ch.basic_get(queue.into(), BasicGetOptions { no_ack: true }).await.unwrap() {
        let props = &m.delivery.properties;
        let id = props
            .message_id()
            .as_ref()
            .map(|s| s.to_string())
            .unwrap_or_else(|| String::from_utf8_lossy(&m.delivery.data).into_owned());
        *seen.entry(id).or_default() += 1;
    }
    seen
}

/// Confirmed ids that are in none of `found`.
fn missing(confirmed: &[String], found: &[&BTreeMap<String, u32>]) -> Vec<String> {
    confirmed.iter().filter(|id| !found.iter().any(|f| f.contains_key(*id))).cloned().collect()
}

/// Issue 31, 1: with no consumer at all, every publish the broker confirmed (through the
/// default exchange with `mandatory`, and through an exchange) is in the queue afterwards, in
/// both directions. The fence once dropped what reached the queue just before it took hold. A
/// publish that reaches a queue as the broker deletes it is confirmed and dropped (RabbitMQ's
/// behaviour), so under default-exchange publishers that never pause the swap does not go
/// ahead, and says why; once they pause, it does.
#[tokio::test]
async fn every_confirmed_publish_is_in_the_queue_after_a_migration_with_no_consumer() {
    for (from, to) in [("classic", "quorum"), ("quorum", "classic")] {
        let name = unique("migrate-confirmed");
        let (before, after, b) =
            declared(&name, &format!("{{type: {from}}}"), &format!("{{type: {to}, onChange: Migrate}}")).await;
        let queue = before.queue.clone();
        let exchange = exchange_bound_to(&queue).await;
        let target = Target::of_queue(&after);
        let route = |tag, exchange: &str, key: &str, stop_after| Route {
            exchange: exchange.to_owned(),
            routing_key: key.to_owned(),
            tag,
            stop_after,
        };
        let uri = common::broker_uri();
        let every = Duration::from_millis(1);

        let unpaused =
            [route("X", &exchange, "work", None), route("D", "", &queue, None), route("E", "", &queue, None)];
        let mut traffic = Traffic::start(&uri, &queue, &unpaused, 0, every, []).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        // Past the statistics interval (5 s) and its lag under a loaded machine: the wait ends
        // on the publishers that never pause, not before a sample after the fence came in.
        let bounds = Bounds { unacknowledged: Duration::from_secs(20), ..Bounds::default() };
        let waited = migrate(&b, &target, None, &mut Recorder::default(), &bounds).await;
        assert!(matches!(waited, Err(migrate::Error::Publishing { .. })), "{from} -> {to}: {waited:?}");
        let (mut confirmed, _, _) = traffic.stop_publishing().await;
        assert_eq!(queue_type(&queue).await, from, "not swapped under them");

        let pausing = [
            route("x", &exchange, "work", None),
            route("d", "", &queue, Some(Duration::from_secs(2))),
            route("e", "", &queue, Some(Duration::from_secs(2))),
        ];
        let mut traffic = Traffic::start(&uri, &queue, &pausing, 0, every, []).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        let ended = tokio::time::timeout(
            Duration::from_secs(90),
            migrate(&b, &target, None, &mut Recorder::default(), &Bounds::default()),
        )
        .await
        .expect("the migration ended");
        let state = moved(ended.unwrap());
        tokio::time::sleep(Duration::from_millis(300)).await;
        let (more, returned, refused) = traffic.stop_publishing().await;
        confirmed.extend(more);
        let held = take_all(&queue).await;
        let lost = missing(&confirmed, &[&held]);
        println!(
            "{from} -> {to}: confirmed {} in the queue {} lost {} | returned {returned} refused {refused} | fenced {:?} ms, swap window {:?} ms",
            confirmed.len(),
            held.len(),
            lost.len(),
            state.fenced_millis,
            state.swap_window_millis
        );
        assert!(lost.is_empty(), "{from} -> {to}: confirmed and gone: {lost:?}");
        assert!(confirmed.len() > 1000, "the publishers ran throughout");
        assert_eq!(state.dropped_at_swap, Some(0));
        assert_eq!(queue_type(&queue).await, to);
        remove_all(&after).await;
    }
}

/// Issue 31, 2: a worker holds 5 of 20 deliveries through the migration. The old queue is not
/// deleted while it holds them: the migration waits (bounded), then moves routes and messages
/// back and says why. The worker requeues them (as one that fails does): all 20 are there, and
/// the next attempt, with nothing held, completes.
#[tokio::test]
async fn deliveries_unacknowledged_at_the_swap_are_never_deleted() {
    let name = unique("migrate-unacked");
    let (before, after, b) = declared(&name, "{type: classic}", "{type: quorum, onChange: Migrate}").await;
    let queue = before.queue.clone();
    let exchange = exchange_bound_to(&queue).await;
    let ids: Vec<String> = (0..20).map(|i| format!("U-{i}")).collect();
    preload(&queue, &ids).await;
    let (worker, ch) = app().await;
    ch.basic_qos(5, lapin::options::BasicQosOptions::default()).await.unwrap();
    let mut deliveries = ch
        .basic_consume(queue.as_str().into(), "holder".into(), Default::default(), FieldTable::default())
        .await
        .unwrap();
    for _ in 0..5 {
        futures::StreamExt::next(&mut deliveries).await.unwrap().unwrap();
    }

    let target = Target::of_queue(&after);
    let bounds = Bounds { unacknowledged: Duration::from_secs(12), ..Bounds::default() };
    let mut journal = Recorder::default();
    let waited = migrate(&b, &target, None, &mut journal, &bounds).await;
    let Err(migrate::Error::Unacknowledged { unacknowledged, .. }) = &waited else {
        panic!("the queue was swapped under 5 unacknowledged deliveries: {waited:?}")
    };
    assert_eq!(*unacknowledged, 5, "{waited:?}");
    assert!(waited.as_ref().unwrap_err().to_string().contains("5 deliveries"), "{waited:?}");
    assert_eq!(queue_type(&queue).await, "classic", "not swapped");
    assert_eq!(exchange_sources(&queue).await, [(exchange.clone(), "work".to_owned())], "routes moved back");
    assert_eq!(counts(&migrate::holding_name(&queue)).await, None, "holding queue gone");
    assert!(fences_of(&queue).await.is_empty(), "fence lifted");
    assert_eq!(journal.last.as_ref().map(|s| s.phase), Some(MigrationPhase::RolledBack));

    // The worker fails: its 5 come back.
    drop(deliveries);
    worker.close(200, "failed".into()).await.unwrap();
    assert!(common::eventually(Duration::from_secs(5), || async { counts(&queue).await == Some((20, 0)) }).await);
    let state = moved(migrate(&b, &target, journal.last.as_ref(), &mut Recorder::default(), &bounds).await.unwrap());
    assert_eq!(queue_type(&queue).await, "quorum");
    let held = take_all(&queue).await;
    assert!(missing(&ids, &[&held]).is_empty(), "{held:?}");
    assert_eq!(state.dropped_at_swap, Some(0));
    remove_all(&after).await;
}

/// Issue 31, 3: a catch-all policy that the queue escapes through its own, higher one matches
/// the holding queue's name; it must not shape the messages held there.
#[tokio::test]
async fn a_foreign_policy_matching_the_holding_queue_does_not_touch_its_messages() {
    let name = unique("migrate-foreign");
    let (before, after, b) = declared(&name, "{type: classic}", "{type: quorum, onChange: Migrate}").await;
    let queue = before.queue.clone();
    let catch_all = format!("catch-all-{name}");
    common::mgmt_put(
        &format!("policies/%2F/{}", enc(&catch_all)),
        serde_json::json!({"pattern": format!("^{}", regex::escape(&queue)), "apply-to": "queues", "priority": 0,
            "definition": {"max-length": 5, "expires": 1000, "message-ttl": 100}}),
    )
    .await;
    let ids: Vec<String> = (0..20).map(|i| format!("F-{i}")).collect();
    preload(&queue, &ids).await;
    let state = moved(
        migrate(&b, &Target::of_queue(&after), None, &mut Recorder::default(), &Bounds::default()).await.unwrap(),
    );
    common::mgmt_delete(&format!("policies/%2F/{}", enc(&catch_all))).await;
    let held = take_all(&queue).await;
    assert!(missing(&ids, &[&held]).is_empty(), "moved out {} back {}: {held:?}", state.moved_out, state.moved_back);
    remove_all(&after).await;
}

/// Issue 31, 4: messages that expire while the holding queue has them are dead-lettered as the
/// queue would have, not dropped.
#[tokio::test]
async fn messages_expiring_while_held_are_dead_lettered() {
    let name = unique("migrate-expiring");
    let (before, after, b) = declared(&name, "{type: classic}", "{type: quorum, onChange: Migrate}").await;
    let queue = before.queue.clone();
    let (_conn, ch) = app().await;
    ch.confirm_select(ConfirmSelectOptions::default()).await.unwrap();
    let publish = |ch: lapin::Channel, queue: String| async move {
        let mut confirmed = Vec::new();
        for i in 0..400 {
            let id = format!("T-{i}");
            let props = BasicProperties::default().with_message_id(id.as_str().into()).with_delivery_mode(2);
            // Every other message lives 150 ms.
            let props = if i % 2 == 0 { props.with_expiration("150".into()) } else { props };
            let c = ch
                .basic_publish(
                    "".into(),
                    queue.as_str().into(),
                    BasicPublishOptions { mandatory: true, ..Default::default() },
                    id.as_bytes(),
                    props,
                )
                .await
                .unwrap()
                .await
                .unwrap();
            if matches!(c, lapin::Confirmation::Ack(None)) {
                confirmed.push(id);
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        confirmed
    };
    let publishing = tokio::spawn(publish(ch, queue.clone()));
    tokio::time::sleep(Duration::from_millis(200)).await;
    let state = moved(
        migrate(&b, &Target::of_queue(&after), None, &mut Recorder::default(), &Bounds::default()).await.unwrap(),
    );
    let confirmed = publishing.await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (held, dead_lettered) = (take_all(&queue).await, take_all(&after.dead_letter_queue).await);
    let lost = missing(&confirmed, &[&held, &dead_lettered]);
    println!(
        "confirmed {} in the queue {} dead-lettered {} lost {} (moved out {} back {})",
        confirmed.len(),
        held.len(),
        dead_lettered.len(),
        lost.len(),
        state.moved_out,
        state.moved_back
    );
    assert!(lost.is_empty(), "neither in the queue nor dead-lettered: {lost:?}");
    remove_all(&after).await;
}

/// A consumer of `queue` on a connection of its own that holds whatever it receives, with the
/// tag `tag`; `exclusive` as basic.consume's flag.
async fn holder(queue: &str, tag: &str, exclusive: bool, prefetch: u16) -> (lapin::Connection, lapin::Consumer) {
    let (conn, ch) = app().await;
    ch.basic_qos(prefetch, lapin::options::BasicQosOptions::default()).await.unwrap();
    let options = lapin::options::BasicConsumeOptions { exclusive, ..Default::default() };
    let consumer = ch.basic_consume(queue.into(), tag.into(), options, FieldTable::default()).await.unwrap();
    (conn, consumer)
}

/// Until the management API lists `tag` among the queue's consumers, or no longer does (its
/// consumer events lag).
async fn listed(queue: &str, tag: &str, wanted: bool) {
    let seen = common::eventually(Duration::from_secs(15), || async {
        let q = mgmt_get(&format!("queues/%2F/{}", enc(queue))).await.unwrap();
        let there = q["consumer_details"].as_array().is_some_and(|cs| cs.iter().any(|c| c["consumer_tag"] == tag));
        there == wanted
    })
    .await;
    assert!(seen, "consumer {tag} listed: {wanted}");
}

async fn publish_to(exchange: &str, key: &str, id: &str) {
    let (_conn, ch) = app().await;
    ch.confirm_select(ConfirmSelectOptions::default()).await.unwrap();
    let props = BasicProperties::default().with_message_id(id.into());
    let confirm = ch
        .basic_publish(exchange.into(), key.into(), BasicPublishOptions::default(), id.as_bytes(), props)
        .await
        .unwrap();
    assert!(confirm.await.unwrap().is_ack());
}

/// Issue 31, 5: an exclusive consumer is refused before anything moves; one that attaches
/// after the start makes the step that meets it move the routes back, so the consumer keeps
/// receiving what is published through the exchange.
#[tokio::test]
async fn an_exclusive_consumer_is_refused_up_front_and_one_met_midway_gets_its_routes_back() {
    let name = unique("migrate-exclusive");
    let (before, after, b) = declared(&name, "{type: classic}", "{type: quorum, onChange: Migrate}").await;
    let queue = before.queue.clone();
    let exchange = exchange_bound_to(&queue).await;
    let target = Target::of_queue(&after);
    {
        let (conn, mut only) = holder(&queue, "only", true, 10).await;
        listed(&queue, "only", true).await;
        let mut journal = Recorder::default();
        let refused = migrate(&b, &target, None, &mut journal, &Bounds::default()).await;
        let Err(migrate::Error::Refused(why)) = &refused else { panic!("not refused: {refused:?}") };
        assert!(why.contains("exclusive consumer ('only')"), "{why}");
        assert!(journal.phases.is_empty(), "nothing was touched");
        publish_to(&exchange, "work", "to-only").await;
        let got = tokio::time::timeout(Duration::from_secs(5), futures::StreamExt::next(&mut only)).await;
        assert!(matches!(got, Ok(Some(Ok(_)))), "the exclusive consumer still receives");
        conn.close(200, "done".into()).await.unwrap();
        listed(&queue, "only", false).await;
    }

    let (mut journal, paused, go) = Recorder::pausing_at(MigrationPhase::Draining);
    let migrating = tokio::spawn({
        let (b, target) = (b.clone(), target.clone());
        async move {
            let ended = migrate(&b, &target, None, &mut journal, &Bounds::default()).await;
            (ended, journal)
        }
    });
    paused.await.unwrap();
    // Routes are on the holding queue now; an exclusive consumer takes the queue.
    let (_conn, mut late) = holder(&queue, "late", true, 10).await;
    go.send(()).unwrap();
    let (ended, journal) = migrating.await.unwrap();
    let Err(migrate::Error::Refused(why)) = &ended else { panic!("not refused midway: {ended:?}") };
    assert!(why.contains("exclusive consumer holds it"), "{why}");
    assert_eq!(journal.last.as_ref().map(|s| s.phase), Some(MigrationPhase::RolledBack));
    assert_eq!(exchange_sources(&queue).await, [(exchange.clone(), "work".to_owned())], "routes moved back");
    assert_eq!(counts(&migrate::holding_name(&queue)).await, None, "holding queue gone");
    publish_to(&exchange, "work", "to-late").await;
    let got = tokio::time::timeout(Duration::from_secs(5), futures::StreamExt::next(&mut late)).await;
    assert!(matches!(got, Ok(Some(Ok(_)))), "the exclusive consumer receives what the exchange routes");
    remove_all(&after).await;
}

/// Issue 31, 6: a single-active-consumer queue whose active consumer holds a message never
/// delivers to the mover: refused up front while consumers are attached; one that attaches
/// after the start stalls the move, which stops after its bound and moves everything back.
#[tokio::test]
async fn a_single_active_consumer_queue_is_refused_or_bounded_never_hung() {
    let queue = unique("migrate-sac");
    let (_conn, ch) = app().await;
    let mut args = FieldTable::default();
    args.insert("x-single-active-consumer".into(), AMQPValue::Boolean(true));
    let durable = lapin::options::QueueDeclareOptions { durable: true, ..Default::default() };
    ch.queue_declare(queue.as_str().into(), durable, args).await.unwrap();
    let exchange = exchange_bound_to(&queue).await;
    let ids: Vec<String> = (0..10).map(|i| format!("S-{i}")).collect();
    preload(&queue, &ids).await;
    let pool = Box::leak(Box::new(BrokerPool::new("qgt-migrate")));
    let b = broker(pool, &plan_of(&policy_doc(&queue, "queue: {type: classic}")));
    let current = migrate::Shape::of(&b.management.queue("/", &queue).await.unwrap().unwrap());
    let (target, _) = Target::converted(&queue, &current, queueguard::crd::QueueType::Quorum);
    let bounds = Bounds { stall: Duration::from_secs(3), ..Bounds::default() };
    {
        let (conn, _active) = holder(&queue, "active", false, 1).await;
        listed(&queue, "active", true).await;
        let refused = migrate(&b, &target, None, &mut Recorder::default(), &bounds).await;
        let Err(migrate::Error::Refused(why)) = &refused else { panic!("not refused: {refused:?}") };
        assert!(why.contains("single active consumer"), "{why}");
        conn.close(200, "done".into()).await.unwrap();
        listed(&queue, "active", false).await;
    }
    assert!(common::eventually(Duration::from_secs(5), || async { counts(&queue).await == Some((10, 0)) }).await);

    let (mut journal, paused, go) = Recorder::pausing_at(MigrationPhase::Draining);
    let migrating = tokio::spawn({
        let (b, target) = (b.clone(), target.clone());
        async move {
            let started = std::time::Instant::now();
            let ended = migrate(&b, &target, None, &mut journal, &bounds).await;
            (ended, journal, started.elapsed())
        }
    });
    paused.await.unwrap();
    let (late, _active) = holder(&queue, "active-late", false, 1).await;
    go.send(()).unwrap();
    let (ended, journal, took) = tokio::time::timeout(Duration::from_secs(60), migrating).await.unwrap().unwrap();
    let Err(migrate::Error::Stalled { ready, .. }) = &ended else { panic!("not stalled: {ended:?}") };
    assert!(*ready > 0, "{ended:?}");
    assert!(took < Duration::from_secs(30), "bounded: {took:?}");
    assert_eq!(journal.last.as_ref().map(|s| s.phase), Some(MigrationPhase::RolledBack));
    assert_eq!(exchange_sources(&queue).await, [(exchange.clone(), "work".to_owned())], "routes moved back");
    assert_eq!(counts(&migrate::holding_name(&queue)).await, None, "holding queue gone");
    assert_eq!(queue_type(&queue).await, "classic");
    late.close(200, "done".into()).await.unwrap();
    let held = {
        assert!(common::eventually(Duration::from_secs(5), || async { counts(&queue).await == Some((10, 0)) }).await);
        take_all(&queue).await
    };
    assert!(missing(&ids, &[&held]).is_empty(), "{held:?}");
    delete_queues(&[&queue]).await;
}

/// Issue 31, 10: a binding whose arguments the broker holds as a short integer moves whole:
/// the queue keeps no binding of its own while the holding queue has the routes (one publish
/// would land in both), and gets it back once.
#[tokio::test]
async fn a_binding_with_typed_arguments_moves_and_comes_back_once() {
    let name = unique("migrate-typed");
    let (before, after, b) = declared(&name, "{type: classic}", "{type: quorum, onChange: Migrate}").await;
    let queue = before.queue.clone();
    let exchange = unique("migrate-headers");
    let (_conn, ch) = app().await;
    ch.exchange_declare(exchange.as_str().into(), ExchangeKind::Headers, Default::default(), FieldTable::default())
        .await
        .unwrap();
    let mut args = FieldTable::default();
    args.insert("x-match".into(), AMQPValue::LongString("all".into()));
    args.insert("n".into(), AMQPValue::ShortInt(5));
    ch.queue_bind(queue.as_str().into(), exchange.as_str().into(), "".into(), QueueBindOptions::default(), args)
        .await
        .unwrap();

    let (journal, paused, go) = Recorder::pausing_at(MigrationPhase::Draining);
    let migrating = tokio::spawn({
        let (b, target) = (b.clone(), Target::of_queue(&after));
        let mut journal = journal;
        async move { migrate(&b, &target, None, &mut journal, &Bounds::default()).await }
    });
    paused.await.unwrap();
    assert_eq!(exchange_sources(&queue).await, [], "every route left the queue");
    assert_eq!(exchange_sources(&migrate::holding_name(&queue)).await, [(exchange.clone(), String::new())]);
    go.send(()).unwrap();
    moved(migrating.await.unwrap().unwrap());
    assert_eq!(exchange_sources(&queue).await, [(exchange.clone(), String::new())], "back once");
    let mut headers = FieldTable::default();
    headers.insert("n".into(), AMQPValue::ShortInt(5));
    ch.confirm_select(ConfirmSelectOptions::default()).await.unwrap();
    let props = BasicProperties::default().with_message_id("h-1".into()).with_headers(headers);
    ch.basic_publish(exchange.as_str().into(), "".into(), BasicPublishOptions::default(), b"h", props)
        .await
        .unwrap()
        .await
        .unwrap();
    assert!(common::eventually(Duration::from_secs(5), || async { counts(&queue).await == Some((1, 0)) }).await);
    assert_eq!(take_all(&queue).await.get("h-1"), Some(&1), "routed once");
    let _ = ch.exchange_delete(exchange.as_str().into(), Default::default()).await;
    remove_all(&after).await;
}

/// Issue 31, 11: `queueguard migrate` resumes a swap cut off between the deletion and the new
/// declaration: the holding queue has the messages, the routes and the target.
#[tokio::test]
async fn the_migrate_command_resumes_a_swap_cut_off_after_the_deletion() {
    let name = unique("migrate-cli-resume");
    let (before, after, b) = declared(&name, "{type: classic}", "{type: quorum, onChange: Migrate}").await;
    let queue = before.queue.clone();
    let exchange = exchange_bound_to(&queue).await;
    let ids: Vec<String> = (0..50).map(|i| format!("R-{i}")).collect();
    preload(&queue, &ids).await;
    let target = Target::of_queue(&after);
    let mut first = Recorder { stop_at: Some(MigrationPhase::Swapping), ..Default::default() };
    let stopped = migrate(&b, &target, None, &mut first, &Bounds::default()).await;
    assert!(matches!(stopped, Err(migrate::Error::NotRecorded { .. })), "{stopped:?}");
    // The swap's deletion, and nothing after it.
    delete_queues(&[&queue]).await;

    let env =
        [("QUEUEGUARD_BROKER_URI", common::broker_uri()), ("QUEUEGUARD_MANAGEMENT_URI", common::management_base())];
    let vhost = ["--vhost", "/"];
    let out =
        common::run_binary(&[&["migrate", queue.as_str(), "--to", "quorum"][..], &vhost[..]].concat(), &env, None);
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(0), "{said}");
    assert!(said.contains("resuming the migration to quorum"), "{said}");
    assert!(said.contains("summary migrated=1"), "{said}");
    assert_eq!(queue_type(&queue).await, "quorum");
    assert_eq!(exchange_sources(&queue).await, [(exchange.clone(), "work".to_owned())]);
    let held = take_all(&queue).await;
    assert!(missing(&ids, &[&held]).is_empty(), "{held:?}");
    remove_all(&after).await;
}

/// Issue 31, 7: a migration left midway (its policy deleted, or no longer saying Migrate) is
/// settled: routes and messages back in the queue, its holding queue and any fence gone, and a
/// queue the swap had deleted declared again.
#[tokio::test]
async fn a_migration_left_midway_is_settled_with_nothing_lost() {
    for stop_at in [MigrationPhase::Draining, MigrationPhase::Swapping] {
        let name = unique("migrate-abandoned");
        let (before, after, b) = declared(&name, "{type: classic}", "{type: quorum, onChange: Migrate}").await;
        let queue = before.queue.clone();
        let exchange = exchange_bound_to(&queue).await;
        let ids: Vec<String> = (0..200).map(|i| format!("A-{i}")).collect();
        preload(&queue, &ids).await;
        let target = Target::of_queue(&after);
        let mut first = Recorder { stop_at: Some(stop_at), ..Default::default() };
        assert!(migrate(&b, &target, None, &mut first, &Bounds::default()).await.is_err());
        assert!(counts(&migrate::holding_name(&queue)).await.is_some(), "left with a holding queue");
        if stop_at == MigrationPhase::Swapping {
            // Cut off inside the swap: its fence up, the queue deleted.
            let fence = migrate::fence(
                &queue,
                &migrate::Shape::of(&b.management.queue("/", &queue).await.unwrap().unwrap()),
                &Default::default(),
                5,
                1,
            );
            b.management.put_policy("/", fence.closed.as_ref().unwrap()).await.unwrap();
            delete_queues(&[&queue]).await;
        }
        let settled = migrate::run::settle_abandoned(&b, &queue, None, &Bounds::default()).await.unwrap();
        assert!(settled, "{stop_at:?}");
        assert_eq!(exchange_sources(&queue).await, [(exchange.clone(), "work".to_owned())], "{stop_at:?}");
        assert_eq!(counts(&migrate::holding_name(&queue)).await, None, "{stop_at:?}");
        assert!(fences_of(&queue).await.is_empty(), "{stop_at:?}");
        let expected = if stop_at == MigrationPhase::Swapping { "quorum" } else { "classic" };
        assert_eq!(queue_type(&queue).await, expected, "{stop_at:?}: declared from the recorded target");
        let held = take_all(&queue).await;
        assert!(missing(&ids, &[&held]).is_empty(), "{stop_at:?}: {} of {}", held.len(), ids.len());
        assert!(!migrate::run::settle_abandoned(&b, &queue, None, &Bounds::default()).await.unwrap(), "nothing left");
        remove_all(&after).await;
    }
}
