//! Each consumer hygiene finding made to happen on the real broker, seen by the operator's own
//! look-and-judge code, and seen to clear once its cause goes. The broker's statistics refresh
//! every 5 s, so each test waits on the finding rather than for a fixed time.

mod common;

use common::*;
use futures::StreamExt;
use lapin::{
    Channel,
    options::{
        BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions, BasicRejectOptions,
        QueueDeclareOptions,
    },
    types::FieldTable,
};
use queueguard::{
    broker::{Broker, BrokerPool, listing::Want, management::LISTING_MAX_AGE, uri::BrokerUri},
    converge::{self, Mode},
    crd::Finding,
    findings::{self, Memory, Report},
    plan::QueuePlan,
};
use serde_json::json;
use std::{sync::Arc, time::Duration};

/// The operator's look at one queue, remembered between looks as the controller does.
struct Looker {
    plan: QueuePlan,
    broker: Arc<Broker>,
    memory: Memory,
    _pool: BrokerPool,
}

impl Looker {
    async fn new(spec_queue: &str, findings_spec: &str) -> Self {
        let name = unique("findings");
        let policy = policy_doc(&name, &format!("queue: {{name: {name}, {spec_queue}}}\n  findings: {findings_spec}"));
        let plan = plan_short(&policy);
        let pool = BrokerPool::new(unique("findings-op"));
        let broker = broker(&pool, &plan);
        assert!(converge::converge(&plan, &broker, &[], Mode::Declare).await.is_ready());
        Self { plan, broker, memory: Memory::default(), _pool: pool }
    }

    fn queue(&self) -> &str {
        &self.plan.queue
    }

    fn queues(&self) -> findings::sample::Queues<'_> {
        findings::sample::Queues { queue: &self.plan.queue, dead_letter_queue: &self.plan.dead_letter_queue }
    }

    async fn look(&mut self) -> Report {
        let seen = findings::sample::sample(self.queues(), &self.broker, None, Duration::ZERO)
            .await
            .expect("the queue can be looked at");
        let (memory, report) = findings::evaluate(&self.memory, &seen, &self.plan.findings);
        self.memory = memory;
        report
    }

    /// Looks until the finding is seen (every second) or gone (every 6 s, so that each look
    /// sees fresh statistics and a cleared finding is not just a stale sample), up to `within`.
    async fn until(&mut self, finding: Finding, present: bool, within: Duration) -> Option<String> {
        let deadline = tokio::time::Instant::now() + within;
        let every = if present { Duration::from_secs(1) } else { Duration::from_secs(6) };
        loop {
            if !present {
                tokio::time::sleep(every).await;
            }
            let report = self.look().await;
            let verdict = report.verdicts.iter().find(|v| v.finding == finding).expect("judged").seen.clone();
            if verdict.is_some() == present {
                return verdict.or(Some(String::new()));
            }
            assert!(tokio::time::Instant::now() < deadline, "{finding:?} never became {present} within {within:?}");
            if present {
                tokio::time::sleep(every).await;
            }
        }
    }

    async fn cleanup(self) {
        remove_all(&self.plan).await;
    }
}

const WAIT: Duration = Duration::from_secs(40);

async fn consume(ch: &Channel, queue: &str, tag: &str, no_ack: bool) -> lapin::Consumer {
    let options = BasicConsumeOptions { no_ack, ..Default::default() };
    ch.basic_consume(queue.into(), tag.into(), options, FieldTable::default()).await.unwrap()
}

#[tokio::test]
async fn prefetch_zero_and_auto_ack_consumers_are_seen_and_clear_when_they_leave() {
    let mut looker = Looker::new("keepAlive: true", "{}").await;
    let (_c1, greedy) = app().await;
    let greedy_consumer = consume(&greedy, looker.queue(), "greedy-worker", false).await;
    let (_c2, careless) = app().await;
    careless.basic_qos(10, BasicQosOptions::default()).await.unwrap();
    let careless_consumer = consume(&careless, looker.queue(), "careless-worker", true).await;

    let unbounded = looker.until(Finding::UnboundedPrefetch, true, WAIT).await.unwrap();
    assert!(unbounded.contains("'greedy-worker'") && !unbounded.contains("careless"), "{unbounded}");
    let auto_ack = looker.until(Finding::AutoAckConsumer, true, WAIT).await.unwrap();
    assert!(auto_ack.contains("'careless-worker'") && !auto_ack.contains("greedy"), "{auto_ack}");

    drop((greedy_consumer, careless_consumer));
    greedy.close(200, "done".into()).await.unwrap();
    careless.close(200, "done".into()).await.unwrap();
    looker.until(Finding::UnboundedPrefetch, false, WAIT).await;
    looker.until(Finding::AutoAckConsumer, false, WAIT).await;
    looker.cleanup().await;
}

#[tokio::test]
async fn a_worker_that_never_acks_is_stalled_and_recovers_when_it_acks() {
    let mut looker = Looker::new("keepAlive: true", "{stallAfter: 2s}").await;
    publish(looker.queue(), (0..3).map(|i| format!("m{i}"))).await;
    let (_conn, ch) = app().await;
    ch.basic_qos(3, BasicQosOptions::default()).await.unwrap();
    let mut hung = consume(&ch, looker.queue(), "hung-worker", false).await;
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(hung.next().await.unwrap().unwrap());
    }
    let stalled = looker.until(Finding::StalledConsumers, true, WAIT).await.unwrap();
    assert!(stalled.contains("prefetch limit (3)"), "{stalled}");

    for delivery in held {
        delivery.ack(BasicAckOptions::default()).await.unwrap();
    }
    looker.until(Finding::StalledConsumers, false, WAIT).await;
    looker.cleanup().await;
}

#[tokio::test]
async fn a_poison_message_requeued_forever_is_a_requeue_loop_until_it_is_rejected() {
    let mut looker = Looker::new("keepAlive: true", "{}").await;
    publish(looker.queue(), ["poison".to_owned()]).await;
    let (_conn, ch) = app().await;
    ch.basic_qos(1, BasicQosOptions::default()).await.unwrap();
    let mut consumer = consume(&ch, looker.queue(), "retrying-worker", false).await;
    let (stop, mut stopped) = tokio::sync::oneshot::channel::<()>();
    let worker = tokio::spawn(async move {
        loop {
            let delivery = consumer.next().await.unwrap().unwrap();
            if stopped.try_recv().is_ok() {
                // The fix: reject without requeue, so it dead-letters.
                delivery.reject(BasicRejectOptions { requeue: false }).await.unwrap();
                return;
            }
            delivery.nack(BasicNackOptions { requeue: true, ..Default::default() }).await.unwrap();
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    });
    let looping = looker.until(Finding::RequeueLoop, true, WAIT).await.unwrap();
    assert!(looping.contains("requeue=false"), "{looping}");

    stop.send(()).unwrap();
    worker.await.unwrap();
    looker.until(Finding::RequeueLoop, false, WAIT).await;
    let dlq = looker.plan.dead_letter_queue.clone();
    assert!(
        eventually(WAIT, || async { counts(&dlq).await == Some((1, 0)) }).await,
        "the poison message dead-lettered"
    );
    looker.cleanup().await;
}

#[tokio::test]
async fn waiting_messages_in_an_unused_expiring_queue_are_at_risk_until_a_consumer_comes() {
    // keepAlive false: only the queue's own use renews its lease. 20 s expiry, at risk after 10 s idle.
    let mut looker = Looker::new("keepAlive: false, expires: 20s", "{}").await;
    publish(looker.queue(), ["waiting".to_owned()]).await;
    let risk = looker.until(Finding::ExpiryRisk, true, Duration::from_secs(18)).await.unwrap();
    assert!(risk.contains("1 messages wait with no consumer"), "{risk}");

    let (_conn, ch) = app().await;
    ch.basic_qos(5, BasicQosOptions::default()).await.unwrap();
    let _rescuer = consume(&ch, looker.queue(), "rescuer", false).await;
    looker.until(Finding::ExpiryRisk, false, WAIT).await;
    looker.cleanup().await;
}

#[tokio::test]
async fn a_dead_letter_queue_that_keeps_growing_is_reported_and_clears_when_it_stops() {
    let mut looker = Looker::new("keepAlive: true", "{}").await;
    let (_conn, ch) = app().await;
    let queue = looker.queue().to_owned();
    // A steady trickle of failures: each rejected message dead-letters.
    let failing = tokio::spawn(async move {
        let mut consumer = consume(&ch, &queue, "failing-worker", false).await;
        while let Some(Ok(delivery)) = consumer.next().await {
            delivery.reject(BasicRejectOptions { requeue: false }).await.unwrap();
        }
    });
    let queue = looker.queue().to_owned();
    let publisher = tokio::spawn(async move {
        for i in 0.. {
            publish(&queue, [format!("order {i}")]).await;
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    });
    let mut grown = None;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while grown.is_none() {
        assert!(tokio::time::Instant::now() < deadline, "DeadLetterGrowing never reported");
        // Looks spaced past the 5 s statistics interval, as the controller's are.
        tokio::time::sleep(Duration::from_secs(6)).await;
        let report = looker.look().await;
        grown = report.verdicts.into_iter().find(|v| v.finding == Finding::DeadLetterGrowing).unwrap().seen;
    }
    assert!(grown.unwrap().contains("grown 3 looks in a row"));

    publisher.abort();
    looker.until(Finding::DeadLetterGrowing, false, WAIT).await;
    failing.abort();
    looker.cleanup().await;
}

/// Twenty policies of one vhost look at their queues through one listing of the vhost per
/// interval, not two reads each (the fleet's management API load at rest), and each still finds
/// its own queue and its dead-letter queue's messages in it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_looks_of_a_vhosts_policies_share_one_queue_listing_per_interval() {
    let pool = BrokerPool::new(unique("listing-op"));
    let mut plans = Vec::new();
    for i in 0..20 {
        let name = unique(&format!("listing-{i}"));
        let plan = plan_short(&policy_doc(&name, &format!("queue: {{name: {name}}}")));
        assert!(converge::converge(&plan, &broker(&pool, &plan), &[], Mode::Declare).await.is_ready());
        plans.push(plan);
    }
    let broker = broker(&pool, &plans[0]);
    let trackers = queueguard::consumers::TrackerPool::new(&unique("listing-op"));
    let tracker = trackers.tracker(&broker.uri, None).unwrap();
    assert!(tracker.wait_synced("/", Duration::from_secs(10)).await);
    // Three dead letters for the first policy, seen once the broker's statistics have them.
    let (_conn, ch) = app().await;
    for _ in 0..3 {
        ch.basic_publish(
            "".into(),
            plans[0].dead_letter_queue.as_str().into(),
            Default::default(),
            b"x",
            Default::default(),
        )
        .await
        .unwrap();
    }
    let counted = eventually(Duration::from_secs(15), || async {
        let want = Want::Queues(&[plans[0].dead_letter_queue.as_str()]);
        let listing = broker.management.queues_in("/", want, Duration::ZERO).await.unwrap();
        listing.queues.get(&plans[0].dead_letter_queue).and_then(|q| q.messages_ready) == Some(3)
    });
    assert!(counted.await, "the broker's statistics count the dead letters");

    async fn look(
        plan: &QueuePlan,
        broker: &Broker,
        tracker: &queueguard::consumers::ConsumerTracker,
        within: Duration,
    ) -> Result<findings::Sample, findings::sample::LookError> {
        let queues = findings::sample::Queues { queue: &plan.queue, dead_letter_queue: &plan.dead_letter_queue };
        findings::sample::sample(queues, broker, Some(tracker), within).await
    }
    let every = Duration::from_secs(3);
    for round in 0..2 {
        // Past the last listing's interval: this round's first look reads a new one.
        tokio::time::sleep(every).await;
        let before = broker.management.requests();
        let looks = futures::future::join_all(plans.iter().map(|p| look(p, &broker, &tracker, every))).await;
        let samples: Vec<_> = looks.into_iter().map(|l| l.expect("each policy finds its queue")).collect();
        assert_eq!(broker.management.requests() - before, 1, "round {round}: one listing for twenty looks");
        assert_eq!(samples[0].dead_letter_ready, Some(3));
        assert!(samples[1..].iter().all(|s| s.dead_letter_ready.unwrap_or_default() == 0));
        assert!(samples.windows(2).all(|w| w[0].now_ms == w[1].now_ms), "one listing's time");
    }
    // Asked for one no older than the call, each look reads again.
    let before = broker.management.requests();
    for plan in &plans[..3] {
        look(plan, &broker, &tracker, Duration::ZERO).await.unwrap();
    }
    assert_eq!(broker.management.requests() - before, 3);
    for plan in &plans {
        remove_all(plan).await;
    }
}

/// The cluster the test broker's management API names, and the one its rabbitmq_prometheus
/// address answers for (None when nothing answers there): port 15692 of its management host, or
/// QUEUEGUARD_TEST_PROMETHEUS.
async fn clusters_here() -> (String, Option<String>, url::Url) {
    queueguard::tls::install_crypto_provider();
    let ours = mgmt_get("overview").await.unwrap()["cluster_name"].as_str().unwrap().to_owned();
    let endpoint = BrokerUri::from_credentials(&common::credentials()).unwrap().management().metrics_urls[0].clone();
    let theirs = match reqwest::get(format!("{endpoint}?family=identity_info")).await {
        Ok(answer) => answer.text().await.ok().and_then(|text| {
            let line = text.lines().find(|l| l.starts_with("rabbitmq_identity_info"))?.to_owned();
            let start = line.find("rabbitmq_cluster=\"")? + "rabbitmq_cluster=\"".len();
            Some(line[start..start + line[start..].find('"')?].to_owned())
        }),
        Err(_) => None,
    };
    (ours, theirs, endpoint)
}

#[tokio::test]
async fn counters_come_from_rabbitmq_prometheus_when_it_answers_for_this_broker_and_agree_with_the_management_api() {
    use queueguard::{broker::prometheus, crd::StatsSource};
    let (ours, at_endpoint, endpoint) = clusters_here().await;
    let expected =
        if at_endpoint.as_deref() == Some(ours.as_str()) { StatsSource::Prometheus } else { StatsSource::Management };
    eprintln!("broker cluster '{ours}', {endpoint} answers for {at_endpoint:?}: expecting {expected:?}");
    if common::prometheus_base().is_some() {
        assert_eq!(expected, StatsSource::Prometheus, "QUEUEGUARD_TEST_PROMETHEUS names this broker's plugin");
    }
    let name = unique("prom");
    let plan = plan_of(&policy_doc(&name, &format!("queue: {{name: {name}}}")));
    let pool = BrokerPool::new(unique("prom-op"));
    let broker = broker(&pool, &plan);
    assert!(converge::converge(&plan, &broker, &[], Mode::Declare).await.is_ready());
    publish(&name, (0..10).map(|i| format!("m{i}"))).await;
    // One consumer acks five and requeues two (redelivered), and stays attached holding the rest.
    let (_conn, ch) = app().await;
    ch.basic_qos(3, BasicQosOptions::default()).await.unwrap();
    let mut deliveries = ch
        .basic_consume(name.as_str().into(), "c".into(), BasicConsumeOptions::default(), FieldTable::default())
        .await
        .unwrap();
    let (mut acked, mut requeued) = (0, 0);
    while acked < 5 {
        let d = deliveries.next().await.unwrap().unwrap();
        if requeued < 2 && !d.redelivered {
            d.nack(BasicNackOptions { requeue: true, ..Default::default() }).await.unwrap();
            requeued += 1;
        } else {
            d.ack(BasicAckOptions::default()).await.unwrap();
            acked += 1;
        }
    }
    let management = || async {
        let q = mgmt_get(&format!("queues/%2F/{}", enc(&name))).await.unwrap_or_default();
        (q["message_stats"]["ack"].as_u64(), q["message_stats"]["redeliver"].as_u64(), q["consumers"].as_i64())
    };
    let settled = eventually(Duration::from_secs(20), || async { management().await == (Some(5), Some(2), Some(1)) });
    assert!(settled.await, "the management API counts 5 acks, 2 redeliveries, 1 consumer: {:?}", management().await);
    let agree = eventually(Duration::from_secs(20), || async {
        let listing = broker.management.queues_in("/", Want::Queues(&[name.as_str()]), Duration::ZERO).await.unwrap();
        let q = &listing.queues[&name];
        listing.source == expected && (q.message_stats.ack, q.message_stats.redeliver, q.consumers) == (5, 2, Some(1))
    });
    assert!(agree.await, "the shared listing ({expected:?}) counts the same");
    let (before, before_scrapes) = (broker.management.requests(), broker.management.prometheus_requests());
    let listing = broker.management.queues_in("/", Want::Queues(&[name.as_str()]), Duration::ZERO).await.unwrap();
    assert_eq!(listing.source, expected);
    assert_eq!(broker.management.requests() - before, 1, "one management request per listing, either way");
    let scrapes = broker.management.prometheus_requests() - before_scrapes;
    match expected {
        StatsSource::Prometheus => assert_eq!(scrapes, 1, "and one scrape of the one node"),
        // Asked once and refused (another cluster answers there): not asked again for a while.
        StatsSource::Management => assert_eq!(scrapes, 0),
    }
    let q = &listing.queues[&name];
    assert_eq!((q.messages_ready, q.messages_unacknowledged), (Some(2), Some(3)), "the same depths");
    if let Some(cluster) = at_endpoint {
        // The identity check: the endpoint's own cluster is read, another name is refused.
        let url = endpoint;
        let http = reqwest::Client::new();
        assert!(prometheus::scrape(&http, &url, "/", &cluster).await.is_ok());
        let err = prometheus::scrape(&http, &url, "/", "some-other-cluster").await.unwrap_err();
        assert!(err.contains(&format!("answers for cluster '{cluster}', not 'some-other-cluster'")), "{err}");
    }
    drop(deliveries);
    common::delete_queues(&[&name, &plan.dead_letter_queue]).await;
}

#[tokio::test]
async fn a_vhost_holding_many_other_queues_is_listed_through_the_name_filter_one_page_of_what_is_wanted() {
    use queueguard::broker::{listing, management::ManagementClient};
    // A vhost of its own with 1,100 queues nobody governs, beside two a policy names and three
    // reply queues a pattern matches.
    let vhost = unique("many");
    mgmt_put(&format!("vhosts/{}", enc(&vhost)), json!({})).await;
    mgmt_put(&format!("permissions/{}/guest", enc(&vhost)), json!({"configure": ".*", "write": ".*", "read": ".*"}))
        .await;
    let mut amqp = url::Url::parse(&broker_uri()).unwrap();
    amqp.set_path(&format!("/{}", enc(&vhost)));
    let conn = lapin::Connection::connect(amqp.as_str(), lapin::ConnectionProperties::default()).await.unwrap();
    let ch = conn.create_channel().await.unwrap();
    let declare = |name: String| {
        let ch = ch.clone();
        async move {
            let options = QueueDeclareOptions { durable: true, ..Default::default() };
            ch.queue_declare(name.as_str().into(), options, FieldTable::default()).await.unwrap();
        }
    };
    for i in 0..1100 {
        declare(format!("other.{i}")).await;
    }
    for name in ["wanted.a", "wanted.b", "wanted.c", "rpc.1", "rpc.2", "rpc.3"] {
        declare(name.to_owned()).await;
    }
    for _ in 0..2 {
        let props = lapin::BasicProperties::default();
        ch.basic_publish("".into(), "wanted.a".into(), Default::default(), b"m", props).await.unwrap().await.unwrap();
    }
    let endpoint = BrokerUri::from_credentials(&common::credentials()).unwrap().management().clone();
    let client = ManagementClient::new(endpoint, None).unwrap();
    const POLICY: &[&str] = &["wanted.a", "wanted.b"];
    let read = |want: listing::Want<'static>, fresh_within: Duration| {
        let (client, vhost) = (client.clone(), vhost.clone());
        async move {
            let before = client.requests();
            let listing = client.queues_in(&vhost, want, fresh_within).await.unwrap();
            let mut names: Vec<String> = listing.queues.keys().cloned().collect();
            names.sort();
            (listing, names, client.requests() - before)
        }
    };

    // The first listing is whole: it shows how many queues the vhost holds.
    let (whole, names, requests) = read(listing::Want::Queues(POLICY), Duration::ZERO).await;
    assert_eq!((whole.filter.is_none(), names.len()), (true, 1106));
    assert!(
        (1..=2).contains(&requests),
        "one listing, first asking the cluster's name for rabbitmq_prometheus: {requests}"
    );
    assert_eq!(whole.seen, listing::Seen { total: 1106, wanted: 2 });
    // Then one page holding only what is wanted, with the same counts.
    let counted = eventually(Duration::from_secs(20), || async {
        let (filtered, names, requests) = read(listing::Want::Queues(POLICY), Duration::ZERO).await;
        filtered.filter.is_some()
            && names == ["wanted.a", "wanted.b"]
            && requests == 1
            && filtered.queues["wanted.a"].messages_ready == Some(2)
    });
    assert!(counted.await, "a filtered page of the two, counting wanted.a's 2 messages");
    // What it already holds is served from it; a queue or pattern it does not hold is read for.
    let (_, _, requests) = read(listing::Want::Queues(&["wanted.b"]), LISTING_MAX_AGE).await;
    assert_eq!(requests, 0, "covered");
    let (_, names, requests) = read(listing::Want::Pattern(r"^rpc\."), LISTING_MAX_AGE).await;
    assert_eq!((names, requests), (["rpc.1", "rpc.2", "rpc.3", "wanted.a", "wanted.b"].map(String::from).to_vec(), 1));
    let (_, names, requests) = read(listing::Want::Queues(&["wanted.c"]), LISTING_MAX_AGE).await;
    assert_eq!((names.len(), names.contains(&"wanted.c".to_owned()), requests), (6, true, 1));
    // Issue 31, 13. A pattern with an `x` flag (valid alone) would comment out the rest of the
    // joined filter: the vhost is listed whole while it is wanted, and filtered again once its
    // QueuePattern is gone.
    let extended = r"(?x)^rpc\. # reply queues";
    let (whole, names, _) = read(listing::Want::Pattern(extended), Duration::ZERO).await;
    assert_eq!((whole.filter.is_none(), names.len()), (true, 1106), "listed whole, and read");
    client.forget_pattern(&vhost, extended);
    let (filtered, names, _) = read(listing::Want::Queues(POLICY), Duration::ZERO).await;
    assert_eq!((filtered.filter.is_some(), names.len()), (true, 6), "filtered again: {names:?}");
    // A filter the broker refuses (RabbitMQ 3.10's regex engine has no `u` flag; 4.0's takes it)
    // falls back to the whole vhost instead of failing every reader of it.
    let foreign = r"(?-u:^rpc\.)";
    let url = format!("queues/{}?page=1&page_size=500&use_regex=true&name={}", enc(&vhost), enc(foreign));
    let refused = common::mgmt_status(&url).await == 400;
    let (listing, names, _) = read(listing::Want::Pattern(foreign), Duration::ZERO).await;
    assert_eq!(listing.filter.is_none(), refused, "whole exactly when the broker refused the filter: {names:?}");
    assert!(names.contains(&"rpc.1".to_owned()) && names.contains(&"wanted.a".to_owned()), "{names:?}");
    let (again, _, requests) = read(listing::Want::Queues(POLICY), Duration::ZERO).await;
    assert_eq!((again.filter.is_none(), requests), (refused, 1), "a refused filter is not sent again");
    client.forget_pattern(&vhost, foreign);
    // A pattern matching more than a page: that listing falls back to the whole vhost, and so
    // does the next (by what it showed).
    let (grown, names, requests) = read(listing::Want::Pattern(r"^other\."), Duration::ZERO).await;
    assert_eq!(
        (grown.filter.is_none(), names.len(), requests),
        (true, 1106, 2),
        "a page that did not hold it, then all"
    );
    let (again, _, requests) = read(listing::Want::Queues(POLICY), Duration::ZERO).await;
    assert_eq!((again.filter.is_none(), requests), (true, 1));
    drop(conn);
    mgmt_delete(&format!("vhosts/{}", enc(&vhost))).await;
}
