//! Gate latency: from a consumer's basic.consume-ok to the operator deciding its pod is attached,
//! through the event exchange (the operator's path) and through management API polling (what a
//! user would otherwise build), over the same attaches in the same run; then a burst of 500.
//!
//! `cargo bench --bench gate_latency` against the local broker (QUEUEGUARD_BENCH_BROKER and
//! QUEUEGUARD_BENCH_MANAGEMENT point elsewhere). Ends with one `key=value` summary line.

use lapin::{Channel, Connection, ConnectionProperties, options::*, types::FieldTable};
use queueguard::{
    broker::uri::BrokerUri,
    consumers::{Change, Consumer, ConsumerTracker, TrackerPool},
    crd::{ConsumersSpec, FailurePolicy, GateMode, MatchBy},
    gate::verdict::{self, Ballot, Vote},
    plan::GatePlan,
};
use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

const QUEUES: usize = 20;
const ATTACHES: usize = 200;
/// Attaches are spread over this long, so the poller sees them arrive at every phase of its cycle.
const SPREAD: Duration = Duration::from_secs(20);
/// How often the user-built poller asks the management API (a typical, already eager choice).
const POLL_EVERY: Duration = Duration::from_millis(1000);
const BURST: usize = 500;

type Seen = Arc<Mutex<HashMap<String, Instant>>>;

fn env(key: &str, default: &str) -> String {
    std::env::var(key).unwrap_or_else(|_| default.to_owned())
}

fn plan() -> GatePlan {
    GatePlan {
        mode: GateMode::Enforce,
        failure_policy: FailurePolicy::Closed,
        attach_timeout: Duration::from_secs(600),
        manage_strategy: false,
        pod_disruption_budget: false,
        min_attached: 1,
        min_attached_for: Duration::ZERO,
        match_by: MatchBy::PodIp,
        consumers: ConsumersSpec {
            deployment: Some("bench".into()),
            workload: None,
            selector: None,
            kinds: None,
            min_attached: 1,
            min_attached_seconds: 0,
            match_by: MatchBy::PodIp,
        },
    }
}

/// The operator's decision for the consumer's pod: its vote on the pod (the index then combines
/// the votes of every policy guarding it).
fn decides_attached(plan: &GatePlan, tracker: &ConsumerTracker, consumer: &Consumer) -> bool {
    let tracking = tracker.tracking(&consumer.queue.vhost);
    let mine = [consumer];
    let now = queueguard::consumers::tracker::now_ms();
    let ballot = Ballot {
        plan,
        tracking: &tracking,
        mine: &mine,
        open: false,
        failed_open: false,
        undated: 0,
        waiting_since: Some(0),
        now,
    };
    matches!(verdict::vote(&ballot).vote, Vote::Open { .. })
}

/// Records when the event path decides each consumer tag attached.
fn event_path(tracker: Arc<ConsumerTracker>, seen: Seen, plan: GatePlan) {
    let mut changes = tracker.subscribe();
    tokio::spawn(async move {
        while let Ok(change) = changes.recv().await {
            if let Change::Attached { consumer } = change
                && decides_attached(&plan, &tracker, &consumer)
            {
                seen.lock().unwrap().entry(consumer.tag.clone()).or_insert_with(Instant::now);
            }
        }
    });
}

/// Records when a management API poller first lists each consumer tag.
fn poll_path(base: String, user: String, pass: String, seen: Seen) {
    tokio::spawn(async move {
        let http = reqwest::Client::new();
        loop {
            let started = Instant::now();
            if let Ok(r) = http.get(format!("{base}/api/consumers/%2F")).basic_auth(&user, Some(&pass)).send().await
                && let Ok(list) = r.json::<Vec<serde_json::Value>>().await
            {
                let now = Instant::now();
                let mut seen = seen.lock().unwrap();
                for c in list {
                    if let Some(tag) = c["consumer_tag"].as_str() {
                        seen.entry(tag.to_owned()).or_insert(now);
                    }
                }
            }
            tokio::time::sleep(POLL_EVERY.saturating_sub(started.elapsed())).await;
        }
    });
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

fn ms(v: f64) -> String {
    format!("{v:.1}")
}

/// Milliseconds from consume-ok to first decision, sorted; negative where the decision came
/// first (the broker emits consumer.created before the client has read its consume-ok).
/// Attaches never decided count as missing.
fn latencies(attached: &HashMap<String, Instant>, seen: &Seen) -> (Vec<f64>, usize) {
    let seen = seen.lock().unwrap();
    let mut out: Vec<f64> = attached
        .iter()
        .filter_map(|(tag, at)| {
            let s = *seen.get(tag)?;
            Some(if s >= *at { (s - *at).as_secs_f64() } else { -(*at - s).as_secs_f64() } * 1000.0)
        })
        .collect();
    out.sort_by(f64::total_cmp);
    let missing = attached.len() - out.len();
    (out, missing)
}

async fn consume(ch: &Channel, queue: &str, tag: &str) -> lapin::Consumer {
    ch.basic_qos(10, BasicQosOptions::default()).await.unwrap();
    ch.basic_consume(queue.into(), tag.into(), BasicConsumeOptions::default(), FieldTable::default()).await.unwrap()
}

#[tokio::main]
async fn main() {
    queueguard::tls::install_crypto_provider();
    let broker = env("QUEUEGUARD_BENCH_BROKER", "amqp://guest:guest@127.0.0.1:5672/%2F");
    let management = env("QUEUEGUARD_BENCH_MANAGEMENT", "http://127.0.0.1:15672");
    let uri = BrokerUri::parse(&broker, Some(&management)).expect("broker URI");
    let pool = TrackerPool::new("queueguard-bench");
    let tracker = pool.tracker(&uri, None).expect("tracker");
    assert!(tracker.wait_synced("/", Duration::from_secs(15)).await, "the tracker syncs");

    let run = format!("qgbench.{}", std::process::id());
    let conn = Connection::connect(&broker, ConnectionProperties::default().with_connection_name("qgbench".into()))
        .await
        .expect("the broker answers");
    let admin = conn.create_channel().await.unwrap();
    let queues: Vec<String> = (0..QUEUES).map(|i| format!("{run}.q{i}")).collect();
    for q in &queues {
        let opts = QueueDeclareOptions { durable: true, ..Default::default() };
        admin.queue_declare(q.as_str().into(), opts, FieldTable::default()).await.unwrap();
    }

    let (events, polls): (Seen, Seen) = Default::default();
    event_path(tracker.clone(), events.clone(), plan());
    poll_path(management.clone(), "guest".into(), "guest".into(), polls.clone());
    tokio::time::sleep(Duration::from_secs(2)).await;

    println!(
        "gate_latency: {ATTACHES} attaches over {} queues, spread over {}s; poller every {}ms",
        QUEUES,
        SPREAD.as_secs(),
        POLL_EVERY.as_millis()
    );
    let mut attached = HashMap::new();
    let mut keep = Vec::new();
    let gap = SPREAD / ATTACHES as u32;
    for i in 0..ATTACHES {
        let ch = conn.create_channel().await.unwrap();
        let tag = format!("{run}.c{i}");
        let consumer = consume(&ch, &queues[i % QUEUES], &tag).await;
        attached.insert(tag, Instant::now());
        keep.push((ch, consumer));
        // A little jitter so attaches do not line up with the poller's period.
        tokio::time::sleep(gap + Duration::from_millis((i as u64 * 37) % 23)).await;
    }
    tokio::time::sleep(POLL_EVERY * 3).await;

    let (event, event_missing) = latencies(&attached, &events);
    let (poll, poll_missing) = latencies(&attached, &polls);
    let row = |name: &str, l: &[f64], missing: usize| {
        let first = l.iter().filter(|v| **v < 0.0).count();
        println!(
            "  {name:<22} n={:<4} p50={:>8}ms p99={:>8}ms max={:>8}ms decided-before-consume-ok={first} missing={missing}",
            l.len(),
            ms(percentile(l, 0.5)),
            ms(percentile(l, 0.99)),
            ms(*l.last().unwrap())
        )
    };
    row("event exchange", &event, event_missing);
    row("management polling", &poll, poll_missing);
    // A p99 at or below zero would make the ratio meaningless: floor the event p99 at 0.1 ms.
    let ratio = percentile(&poll, 0.99) / percentile(&event, 0.99).max(0.1);
    println!("  ratio poll p99 / event p99 = {ratio:.1}");

    // The burst: 500 consumers within a second, on a few connections as a scaled-up Deployment
    // would have; time from the last consume-ok until the last decision.
    println!("burst: {BURST} consumers attaching at once");
    let mut conns = Vec::new();
    for i in 0..10 {
        let name = format!("qgbench-burst-{i}");
        conns.push(
            Connection::connect(&broker, ConnectionProperties::default().with_connection_name(name.into()))
                .await
                .unwrap(),
        );
    }
    let burst_started = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..BURST {
        let ch = conns[i % conns.len()].create_channel().await.unwrap();
        let queue = queues[i % QUEUES].clone();
        let tag = format!("{run}.b{i}");
        tasks.push(tokio::spawn(async move {
            let consumer = consume(&ch, &queue, &tag).await;
            (tag, Instant::now(), ch, consumer)
        }));
    }
    let mut burst = HashMap::new();
    for t in tasks {
        let (tag, at, ch, consumer) = t.await.unwrap();
        burst.insert(tag, at);
        keep.push((ch, consumer));
    }
    let last_attach = *burst.values().max().unwrap();
    let attach_window = (last_attach - burst_started).as_secs_f64() * 1000.0;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let decided = {
            let s = events.lock().unwrap();
            burst.keys().filter(|t| s.contains_key(*t)).count()
        };
        if decided == BURST || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let (burst_lat, burst_missing) = latencies(&burst, &events);
    let last_decided = {
        let s = events.lock().unwrap();
        burst.keys().filter_map(|t| s.get(t)).max().copied().unwrap_or(last_attach)
    };
    let after_last = last_decided.saturating_duration_since(last_attach).as_secs_f64() * 1000.0;
    println!(
        "  attached within {}ms; last decided {}ms after the last attach; per-consumer p99={}ms; missing={burst_missing}",
        ms(attach_window),
        ms(after_last),
        ms(percentile(&burst_lat, 0.99))
    );

    drop(keep);
    for q in &queues {
        let _ = admin.queue_delete(q.as_str().into(), QueueDeleteOptions::default()).await;
    }
    println!(
        "summary event_p50_ms={} event_p99_ms={} event_max_ms={} poll_p50_ms={} poll_p99_ms={} poll_max_ms={} ratio={ratio:.1} burst={BURST} burst_attach_window_ms={} burst_last_decided_after_ms={} missing={}",
        ms(percentile(&event, 0.5)),
        ms(percentile(&event, 0.99)),
        ms(*event.last().unwrap()),
        ms(percentile(&poll, 0.5)),
        ms(percentile(&poll, 0.99)),
        ms(*poll.last().unwrap()),
        ms(attach_window),
        ms(after_last),
        event_missing + poll_missing + burst_missing
    );
}
