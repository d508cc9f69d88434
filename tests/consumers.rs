//! Consumer tracking against the real broker: events, snapshots, the polling fallback, queue
//! deletion, and the `queueguard consumers` command.

mod common;

use common::*;
use lapin::{
    Connection, ConnectionProperties,
    options::{BasicCancelOptions, BasicConsumeOptions, BasicQosOptions, QueueDeclareOptions, QueueDeleteOptions},
    types::FieldTable,
};
use queueguard::{
    broker::uri::BrokerUri,
    consumers::{Change, ConsumerTracker, QueueKey, TrackerPool, Tracking},
};
use serde_json::json;
use std::{sync::Arc, time::Duration};

fn tracker(uri: &str) -> Arc<ConsumerTracker> {
    let pool = TrackerPool::new(&unique("tracker"));
    let uri = BrokerUri::parse(uri, Some(&management_base())).unwrap();
    pool.tracker(&uri, None).unwrap()
}

async fn declare(name: &str) {
    let (_c, ch) = app().await;
    let durable = QueueDeclareOptions { durable: true, ..Default::default() };
    ch.queue_declare(name.into(), durable, FieldTable::default()).await.unwrap();
}

async fn named_app(connection_name: &str) -> (Connection, lapin::Channel) {
    let conn = Connection::connect(
        &broker_uri(),
        ConnectionProperties::default().with_connection_name(connection_name.into()),
    )
    .await
    .unwrap();
    let ch = conn.create_channel().await.unwrap();
    (conn, ch)
}

/// A tracker whose events flow, a new durable queue it keeps track of, and its change stream.
struct Tracked {
    t: Arc<ConsumerTracker>,
    name: String,
    key: QueueKey,
    rx: tokio::sync::broadcast::Receiver<Change>,
    _interest: queueguard::consumers::tracker::Interest,
}

async fn tracked(prefix: &str) -> Tracked {
    let t = tracker(&broker_uri());
    assert!(t.wait_synced("/", Duration::from_secs(10)).await);
    let events = eventually(Duration::from_secs(5), || async { t.tracking("/") == Tracking::Events });
    assert!(events.await, "{:?}", t.tracking("/"));
    let name = unique(prefix);
    declare(&name).await;
    let key = QueueKey::new("/", &name);
    let _interest = t.watch(key.clone());
    let rx = t.subscribe();
    Tracked { t, name, key, rx, _interest }
}

#[tokio::test]
async fn events_report_attach_and_detach_with_peer_connection_prefetch_and_ack_mode() {
    let Tracked { t, name, key, mut rx, _interest } = tracked("tracked").await;

    let pod = unique("worker-pod");
    let (conn, ch) = named_app(&pod).await;
    ch.basic_qos(25, BasicQosOptions::default()).await.unwrap();
    let started = std::time::Instant::now();
    let _consumer = ch
        .basic_consume(name.as_str().into(), "c1".into(), BasicConsumeOptions::default(), FieldTable::default())
        .await
        .unwrap();
    let Some(Change::Attached { consumer }) = next_change_on(&mut rx, &key, Duration::from_secs(2)).await else {
        panic!("no attach event within 2 s")
    };
    assert!(started.elapsed() < Duration::from_secs(1), "events arrive well before management statistics would");
    assert_eq!(consumer.tag, "c1");
    assert_eq!(consumer.peer_host.as_deref(), Some("127.0.0.1"));
    assert_eq!(consumer.connection_name.as_deref(), Some(pod.as_str()));
    assert_eq!((consumer.prefetch, consumer.ack_required), (25, true));
    assert_eq!(t.consumers_on(&key).len(), 1);

    ch.basic_cancel("c1".into(), BasicCancelOptions::default()).await.unwrap();
    assert!(matches!(next_change_on(&mut rx, &key, Duration::from_secs(2)).await, Some(Change::Detached { .. })));
    assert!(t.consumers_on(&key).is_empty());

    // A consumer whose connection simply goes away is detached as well.
    let auto_ack = BasicConsumeOptions { no_ack: true, ..Default::default() };
    let _c2 = ch.basic_consume(name.as_str().into(), "c2".into(), auto_ack, FieldTable::default()).await.unwrap();
    let Some(Change::Attached { consumer }) = next_change_on(&mut rx, &key, Duration::from_secs(2)).await else {
        panic!()
    };
    assert!(!consumer.ack_required);
    conn.close(200, "bye".into()).await.unwrap();
    assert!(matches!(next_change_on(&mut rx, &key, Duration::from_secs(2)).await, Some(Change::Detached { .. })));
    delete_queues(&[&name]).await;
}

#[tokio::test]
async fn consumers_that_predate_the_tracker_come_from_the_snapshot() {
    let name = unique("predates");
    declare(&name).await;
    let pod = unique("old-pod");
    let (_conn, ch) = named_app(&pod).await;
    let _early = ch
        .basic_consume(name.as_str().into(), "early".into(), BasicConsumeOptions::default(), FieldTable::default())
        .await
        .unwrap();
    let key = QueueKey::new("/", &name);
    // The management API lists a consumer, and separately its connection, after their
    // statistics intervals: the consumer can be listed seconds before its connection's name.
    let lists = |path: &'static str, pointer: &'static str, value: String| async move {
        mgmt_get(path).await.unwrap().as_array().unwrap().iter().any(|row| row.pointer(pointer) == Some(&json!(value)))
    };
    // A new consumer is listed with empty channel_details until its channel's statistics are in;
    // the tracker leaves such a row out.
    let listed = eventually(Duration::from_secs(15), || async {
        let consumers = mgmt_get("consumers/%2F").await.unwrap();
        let with_channel = consumers.as_array().unwrap().iter().any(|c| {
            c.pointer("/queue/name") == Some(&json!(name))
                && c.pointer("/channel_details/name").is_some_and(|n| n.is_string())
        });
        with_channel && lists("connections", "/user_provided_name", pod.clone()).await
    });
    assert!(listed.await);
    let t = tracker(&broker_uri());
    let _interest = t.watch(key.clone());
    assert!(t.wait_synced("/", Duration::from_secs(10)).await);
    let found = t.consumers_on(&key);
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(found[0].tag, "early");
    assert_eq!(found[0].connection_name.as_deref(), Some(pod.as_str()), "named through the connection list");
    delete_queues(&[&name]).await;
}

/// A queue watched after its vhost was first read (a second policy bound after an operator
/// restart) has consumers only a snapshot can show: until one taken after its watch began is in,
/// its tracking says Starting, never live with no consumers (which closed open gates).
#[tokio::test]
async fn a_queue_watched_after_its_vhost_was_read_is_starting_until_a_snapshot_lists_it() {
    let name = unique("watched-late");
    declare(&name).await;
    let pod = unique("late-pod");
    let (_conn, ch) = named_app(&pod).await;
    let _early = ch
        .basic_consume(name.as_str().into(), "early".into(), BasicConsumeOptions::default(), FieldTable::default())
        .await
        .unwrap();
    let listed = eventually(Duration::from_secs(15), || async {
        let consumers = mgmt_get("consumers/%2F").await.unwrap();
        consumers.as_array().unwrap().iter().any(|c| {
            c.pointer("/queue/name") == Some(&json!(name))
                && c.pointer("/channel_details/name").is_some_and(|n| n.is_string())
        })
    });
    assert!(listed.await);
    // The vhost is read and live through another queue's watch first.
    let Tracked { t, _interest: _first, .. } = tracked("first-bound").await;
    let key = QueueKey::new("/", &name);
    let _interest = t.watch(key.clone());
    let started = std::time::Instant::now();
    assert_eq!(t.tracking_of(&key), Tracking::Starting, "nothing read of it yet");
    let mut seen_live = false;
    while started.elapsed() < Duration::from_secs(10) {
        let (tracking, found) = (t.tracking_of(&key), t.consumers_on(&key));
        if tracking.is_live() {
            assert_eq!(found.len(), 1, "live, so its consumers are known: {found:?}");
            seen_live = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(seen_live, "a snapshot came within 10 s: {}", t.tracking_of(&key));
    assert!(t.wait_synced("/", Duration::from_secs(1)).await);
    delete_queues(&[&name]).await;
}

#[tokio::test]
async fn a_watched_queue_deleted_behind_our_back_is_noticed() {
    let Tracked { t, name, key, mut rx, _interest } = tracked("deleted").await;
    let (_c, ch) = app().await;
    ch.queue_delete(name.as_str().into(), QueueDeleteOptions::default()).await.unwrap();
    assert!(matches!(next_change_on(&mut rx, &key, Duration::from_secs(2)).await, Some(Change::QueueDeleted { .. })));
    assert!(t.take_deleted(&key));
    assert!(!t.take_deleted(&key), "reported once");
}

/// A broker user that may not read amq.rabbitmq.event: the tracker polls the management API and
/// says why, and still sees consumers and deletions.
#[tokio::test]
async fn without_events_the_tracker_polls_and_says_so() {
    let user = unique("noevents").replace('.', "-");
    mgmt_put(&format!("users/{}", enc(&user)), json!({"password": "pw-noevents", "tags": "monitoring"})).await;
    mgmt_put(
        &format!("permissions/%2F/{}", enc(&user)),
        json!({"configure": ".*", "write": ".*", "read": "^(amq\\.gen.*|qgt\\..*)$"}),
    )
    .await;
    let url = {
        let mut u = url::Url::parse(&broker_uri()).unwrap();
        u.set_username(&user).unwrap();
        u.set_password(Some("pw-noevents")).unwrap();
        u.to_string()
    };
    let mgmt = {
        let mut u = url::Url::parse(&management_base()).unwrap();
        u.set_username(&user).unwrap();
        u.set_password(Some("pw-noevents")).unwrap();
        u.to_string()
    };
    let pool = TrackerPool::new(&unique("tracker"));
    let t = pool.tracker(&BrokerUri::parse(&url, Some(&mgmt)).unwrap(), None).unwrap();
    let polling = eventually(Duration::from_secs(10), || async {
        matches!(t.tracking("/"), Tracking::Polling(why) if why.contains("may not read amq.rabbitmq.event"))
    });
    assert!(polling.await, "{:?}", t.tracking("/"));

    let name = unique("polled");
    declare(&name).await;
    let key = QueueKey::new("/", &name);
    let _interest = t.watch(key.clone());
    let (_conn, ch) = app().await;
    let _p1 = ch
        .basic_consume(name.as_str().into(), "p1".into(), BasicConsumeOptions::default(), FieldTable::default())
        .await
        .unwrap();
    let seen = eventually(Duration::from_secs(15), || async { t.consumers_on(&key).len() == 1 }).await;
    assert!(seen, "polling finds the consumer within the statistics interval plus the polling period");
    ch.queue_delete(name.as_str().into(), QueueDeleteOptions::default()).await.unwrap();
    let noticed = eventually(Duration::from_secs(10), || async { t.take_deleted(&key) }).await;
    assert!(noticed, "the deletion shows up between two snapshots");
    mgmt_delete(&format!("users/{}", enc(&user))).await;
}

#[test]
fn the_consumers_command_lists_and_watches() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let name = unique("cli-consumers");
    let (_conn, _ch, _listed) = rt.block_on(async {
        declare(&name).await;
        let (conn, ch) = named_app("cli-pod-1").await;
        ch.basic_qos(3, BasicQosOptions::default()).await.unwrap();
        let c = ch
            .basic_consume(name.as_str().into(), "listed".into(), BasicConsumeOptions::default(), FieldTable::default())
            .await
            .unwrap();
        (conn, ch, c)
    });
    let bin = env!("CARGO_BIN_EXE_queueguard");
    let env = [("QUEUEGUARD_BROKER_URI", broker_uri()), ("QUEUEGUARD_MANAGEMENT_URI", management_base())];
    // The consumer is seen by event only if the tracker subscribed first; the snapshot needs the
    // statistics interval, so retry for a while.
    let mut listed = json!([]);
    for _ in 0..30 {
        let out = std::process::Command::new(bin)
            .args(["consumers", &name, "-o", "json"])
            .envs(env.clone())
            .output()
            .unwrap();
        assert!(out.status.success(), "queueguard consumers failed: {}", String::from_utf8_lossy(&out.stderr));
        listed = serde_json::from_slice(&out.stdout).unwrap();
        if !listed.as_array().unwrap().is_empty() {
            break;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    let c = &listed[0];
    assert_eq!(
        (c["tag"].as_str(), c["peerHost"].as_str(), c["connectionName"].as_str()),
        (Some("listed"), Some("127.0.0.1"), Some("cli-pod-1"))
    );
    assert_eq!((c["prefetch"].as_u64(), c["ackMode"].as_str()), (Some(3), Some("manual")));
    let table = std::process::Command::new(bin).args(["consumers", &name]).envs(env.clone()).output().unwrap();
    let text = String::from_utf8(table.stdout).unwrap();
    assert!(text.starts_with("TAG") && text.contains("listed") && text.contains("cli-pod-1"), "{text}");

    let mut watch = std::process::Command::new(bin)
        .args(["consumers", &name, "--watch", "-o", "json"])
        .envs(env)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = watch.stdout.take().unwrap();
    let lines = std::thread::spawn(move || {
        use std::io::BufRead;
        std::io::BufReader::new(stdout).lines().take(2).collect::<Result<Vec<_>, _>>().unwrap()
    });
    std::thread::sleep(Duration::from_secs(2));
    rt.block_on(async {
        let (_c2, ch2) = named_app("cli-pod-2").await;
        let _watched = ch2
            .basic_consume(
                name.as_str().into(),
                "watched".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(500)).await;
    });
    let lines = lines.join().unwrap();
    let _ = watch.kill();
    let _ = watch.wait();
    let event: serde_json::Value = serde_json::from_str(&lines[1]).unwrap();
    assert_eq!(event["event"], "attached", "{lines:?}");
    assert_eq!(event["consumer"]["tag"], "watched");
    assert!(event["time"].as_str().unwrap().ends_with('Z'));
    rt.block_on(delete_queues(&[&name]));
}

/// `queueguard consumers --watch` started while a client's connection is already open, with two
/// channels (their `channel.created` came before the subscription): a consumer that was there
/// before leaves one at once; consumers opened on the other one after another are printed
/// attaching within 7 s (the first waits for a management snapshot to place its channel; after
/// that the channel is known) and detaching within 1 s.
#[test]
fn the_watch_sees_consumers_come_and_go_on_channels_opened_before_it() {
    use std::io::BufRead;
    let rt = tokio::runtime::Runtime::new().unwrap();
    let name = unique("cli-early");
    let (conn, early_ch, ch, early) = rt.block_on(async {
        declare(&name).await;
        let (conn, early_ch) = named_app("early-pod").await;
        let ch = conn.create_channel().await.unwrap();
        let early = early_ch
            .basic_consume(name.as_str().into(), "early".into(), BasicConsumeOptions::default(), FieldTable::default())
            .await
            .unwrap();
        // Listed with its channel: until the channel's statistics are in, the management API
        // lists a new consumer with empty channel_details, which the tracker leaves out.
        let listed = eventually(Duration::from_secs(15), || async {
            mgmt_get("consumers/%2F").await.unwrap().as_array().unwrap().iter().any(|c| {
                c["consumer_tag"] == "early"
                    && c["queue"]["name"] == name.as_str()
                    && c["channel_details"]["name"].is_string()
            })
        });
        assert!(listed.await);
        (conn, early_ch, ch, early)
    });
    let mut watch = std::process::Command::new(env!("CARGO_BIN_EXE_queueguard"))
        .args(["consumers", &name, "--watch", "-o", "json"])
        .envs([("QUEUEGUARD_BROKER_URI", broker_uri()), ("QUEUEGUARD_MANAGEMENT_URI", management_base())])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = watch.stdout.take().unwrap();
    let (tx, lines) = std::sync::mpsc::channel::<(std::time::Instant, String)>();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send((std::time::Instant::now(), line));
        }
    });
    let (_, listing) = lines.recv_timeout(Duration::from_secs(20)).expect("the initial listing");
    let listing: serde_json::Value = serde_json::from_str(&listing).unwrap();
    assert_eq!(listing[0]["tag"], "early", "{listing}");
    std::thread::sleep(Duration::from_secs(1)); // the event subscription is up
    let next_event = |within: Duration| -> (Duration, serde_json::Value) {
        let start = std::time::Instant::now();
        let (at, line) = lines.recv_timeout(within).unwrap_or_else(|_| panic!("nothing printed within {within:?}"));
        (at.duration_since(start), serde_json::from_str(&line).unwrap())
    };
    let mut figures = Vec::new();
    rt.block_on(async {
        drop(early);
        early_ch.basic_cancel("early".into(), BasicCancelOptions::default()).await.unwrap();
    });
    let (detach, event) = next_event(Duration::from_secs(1));
    assert_eq!((event["event"].as_str(), event["consumer"]["tag"].as_str()), (Some("detached"), Some("early")));
    figures.push(format!("early: detach printed after {detach:?}"));
    for i in 0..3 {
        let tag = format!("c{i}");
        let consumer = rt.block_on(async {
            ch.basic_consume(
                name.as_str().into(),
                tag.as_str().into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap()
        });
        let (attach, event) = next_event(Duration::from_secs(7));
        assert_eq!(
            (event["event"].as_str(), event["consumer"]["tag"].as_str()),
            (Some("attached"), Some(tag.as_str()))
        );
        assert_eq!(event["consumer"]["connectionName"], "early-pod");
        std::thread::sleep(Duration::from_millis(500));
        rt.block_on(async {
            drop(consumer);
            ch.basic_cancel(tag.as_str().into(), BasicCancelOptions::default()).await.unwrap();
        });
        let (detach, event) = next_event(Duration::from_secs(1));
        assert_eq!(
            (event["event"].as_str(), event["consumer"]["tag"].as_str()),
            (Some("detached"), Some(tag.as_str()))
        );
        figures.push(format!("{tag}: attach printed after {attach:?}, detach after {detach:?}"));
    }
    eprintln!("{}", figures.join("\n"));
    let _ = watch.kill();
    let _ = watch.wait();
    drop(conn);
    rt.block_on(delete_queues(&[&name]));
}

/// One vhost the broker user may not read makes only that vhost's tracking Unavailable, naming
/// the read that failed; the others stay live.
#[tokio::test]
async fn a_vhost_the_user_cannot_read_leaves_the_others_tracked() {
    let user = unique("vhostless").replace('.', "-");
    let vhost = unique("vh").replace('.', "-");
    mgmt_put(&format!("vhosts/{}", enc(&vhost)), json!({})).await;
    mgmt_put(&format!("users/{}", enc(&user)), json!({"password": "pw-vh", "tags": "management"})).await;
    mgmt_put(&format!("permissions/%2F/{}", enc(&user)), json!({"configure": ".*", "write": ".*", "read": ".*"})).await;
    let with_user = |base: &str| {
        let mut u = url::Url::parse(base).unwrap();
        u.set_username(&user).unwrap();
        u.set_password(Some("pw-vh")).unwrap();
        u.to_string()
    };
    let pool = TrackerPool::new(&unique("tracker"));
    let t = pool
        .tracker(&BrokerUri::parse(&with_user(&broker_uri()), Some(&with_user(&management_base()))).unwrap(), None)
        .unwrap();
    t.track_vhost(&vhost);
    assert!(
        eventually(Duration::from_secs(10), || async { t.tracking("/") == Tracking::Events }).await,
        "{:?}",
        t.tracking("/")
    );
    let denied = eventually(Duration::from_secs(10), || async {
        matches!(t.tracking(&vhost), Tracking::Unavailable(why) if why.contains(&format!("reading the queues of vhost '{vhost}'")) && why.contains("401"))
    });
    assert!(denied.await, "{vhost}: {}", t.tracking(&vhost));
    assert_eq!(t.tracking("/"), Tracking::Events, "the readable vhost stays live");
    mgmt_delete(&format!("users/{}", enc(&user))).await;
    mgmt_delete(&format!("vhosts/{}", enc(&vhost))).await;
}

/// Any broker user can make the event exchange publish a large header: a `basic.consume` with
/// more than the operator's 32 KiB frame size of arguments, in any vhost, becomes a
/// `consumer.created` event carrying those arguments. The subscription must live through it
/// (the same connection, no resubscription and resync) and go on seeing attaches by event.
#[tokio::test]
async fn a_consume_with_huge_arguments_does_not_cut_the_event_subscription() {
    let connection_name = unique("tracker");
    let pool = TrackerPool::new(&connection_name);
    let t = pool.tracker(&BrokerUri::parse(&broker_uri(), Some(&management_base())).unwrap(), None).unwrap();
    assert!(t.wait_synced("/", Duration::from_secs(10)).await);
    assert!(eventually(Duration::from_secs(5), || async { t.tracking("/") == Tracking::Events }).await);
    let events_connection = || async {
        let rows = mgmt_get("connections?columns=name,user_provided_name").await.unwrap();
        let mine = format!("{connection_name} (events)");
        let names: Vec<String> = rows
            .as_array()
            .unwrap()
            .iter()
            .filter(|c| c["user_provided_name"].as_str() == Some(mine.as_str()))
            .map(|c| c["name"].as_str().unwrap().to_owned())
            .collect();
        names
    };
    let listed = eventually(Duration::from_secs(15), || async { events_connection().await.len() == 1 });
    assert!(listed.await, "the tracker's events connection is listed");
    let before = events_connection().await;
    let mut rx = t.subscribe();
    let mut tracking_changes = t.subscribe();

    // 64 KiB was enough to cut a 32 KiB events connection; 126 KiB is about the most a
    // consume can carry and still come back in an event within the broker's 128 KiB frames.
    let hostile = unique("huge-args");
    declare(&hostile).await;
    let _hostile_interest = t.watch(QueueKey::new("/", &hostile));
    let (_hostile_conn, hostile_ch) = named_app(&unique("hostile")).await;
    let mut consumers = Vec::new();
    for (i, padding) in [64 * 1024, 126 * 1024].into_iter().enumerate() {
        consumers.push(huge_consume(&hostile_ch, &hostile, &format!("huge-{i}"), padding).await.expect("taken"));
        let seen = next_change_on(&mut rx, &QueueKey::new("/", &hostile), Duration::from_secs(3)).await;
        assert!(
            matches!(seen, Some(Change::Attached { .. })),
            "{padding} bytes of arguments: seen by event, not {:?}",
            seen.map(|c| format!("{c:?}").chars().take(200).collect::<String>())
        );
    }

    // Still subscribed: an ordinary attach right after is seen within a second, by event.
    let name = unique("after-huge");
    declare(&name).await;
    let key = QueueKey::new("/", &name);
    let _interest = t.watch(key.clone());
    let (_conn, ch) = named_app(&unique("worker")).await;
    let started = std::time::Instant::now();
    let _c = ch
        .basic_consume(name.as_str().into(), "c".into(), BasicConsumeOptions::default(), FieldTable::default())
        .await
        .unwrap();
    let attached = next_change_on(&mut rx, &key, Duration::from_secs(3)).await;
    assert!(matches!(attached, Some(Change::Attached { .. })), "{attached:?}");
    assert!(started.elapsed() < Duration::from_secs(1), "by event, not by snapshot: {:?}", started.elapsed());
    let mut resubscribed = false;
    while let Ok(change) = tracking_changes.try_recv() {
        resubscribed |= matches!(change, Change::Tracking { vhost: None });
    }
    assert!(!resubscribed, "the event subscription was lost and made again");
    assert_eq!(t.tracking("/"), Tracking::Events);
    assert_eq!(events_connection().await, before, "the same events connection throughout");
    delete_queues(&[&name, &hostile]).await;
}

/// A consume carrying `padding` bytes of arguments.
async fn huge_consume(ch: &lapin::Channel, queue: &str, tag: &str, padding: usize) -> lapin::Result<lapin::Consumer> {
    let mut arguments = FieldTable::default();
    arguments.insert("x-padding".into(), lapin::types::AMQPValue::LongString("x".repeat(padding).into()));
    ch.basic_consume(queue.into(), tag.into(), BasicConsumeOptions::default(), arguments).await
}

/// What no frame size can absorb: a consume at the broker's own frame limit comes back as an
/// event header a few hundred bytes larger, which lapin refuses, closing the connection (the
/// broker does not split header frames). Repeated, it must not make the tracker subscribe and
/// resync every vhost every half second: a subscription that ends within seconds backs off.
///
/// It cuts every event subscription on the broker, other tests' too, so it runs only when
/// asked, alone (`scripts/test.sh` does, after the suite).
#[tokio::test]
async fn consumes_at_the_frame_limit_repeated_make_the_subscription_back_off() {
    if std::env::var("QUEUEGUARD_TEST_EVENT_FLOOD").as_deref() != Ok("1") {
        eprintln!("skipped: set QUEUEGUARD_TEST_EVENT_FLOOD=1 to cut every event subscription on the broker");
        return;
    }
    let pool = TrackerPool::new(&unique("tracker"));
    let t = pool.tracker(&BrokerUri::parse(&broker_uri(), Some(&management_base())).unwrap(), None).unwrap();
    assert!(t.wait_synced("/", Duration::from_secs(10)).await);
    assert!(eventually(Duration::from_secs(5), || async { t.tracking("/") == Tracking::Events }).await);
    let hostile = unique("limit-args");
    declare(&hostile).await;
    let (_conn, ch) = named_app(&unique("hostile")).await;
    let opened_before = pool.connections_opened();
    let started = std::time::Instant::now();
    let mut i = 0;
    while started.elapsed() < Duration::from_secs(8) {
        let consumer = huge_consume(&ch, &hostile, &format!("limit-{i}"), 130_900).await.expect("the broker takes it");
        drop(consumer);
        i += 1;
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let subscriptions = pool.connections_opened() - opened_before;
    eprintln!("{i} consumes at the frame limit in 8 s: {subscriptions} new subscriptions");
    assert!(subscriptions >= 1, "the refused frame did cut the subscription (what this test is about)");
    assert!(subscriptions <= 6, "backed off (0.5 + 1 + 2 + 4 s), not every half second: {subscriptions}");
    delete_queues(&[&hostile]).await;
}

/// The tracker keeps only what a policy needs, and lets go of it: 1,000 client connections
/// with a consumer each come and go in ten waves, while 100 policies' interests (queue and
/// dead-letter queue, as the gate binds them) come and go ten at a time. Afterwards the
/// tracker holds exactly what it held before (nothing), and connections of vhosts no policy
/// names are never kept at all. In a vhost of its own, so other tests' traffic is not counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_churn_of_connections_and_policies_leaves_the_tracker_as_it_was() {
    let vhost = unique("churn").replace('.', "-");
    mgmt_put(&format!("vhosts/{}", enc(&vhost)), json!({})).await;
    mgmt_put(&format!("permissions/{}/guest", enc(&vhost)), json!({"configure": ".*", "write": ".*", "read": ".*"}))
        .await;
    let uri = format!("{}{}", broker_uri().trim_end_matches("%2F"), enc(&vhost));
    let pool = TrackerPool::new(&unique("tracker"));
    let t = pool.tracker(&BrokerUri::parse(&broker_uri(), Some(&management_base())).unwrap(), None).unwrap();
    let empty = t.footprint();
    assert_eq!(empty, (Default::default(), 0, 0));

    let mut previous: Vec<queueguard::consumers::tracker::Interest> = Vec::new();
    for wave in 0..10 {
        // Ten new policies take over from the last wave's.
        let queues: Vec<String> = (0..10).map(|i| format!("q{wave}.{i}")).collect();
        let interests: Vec<_> = queues
            .iter()
            .flat_map(|q| [q.clone(), format!("{q}.dlq")])
            .map(|q| t.watch(QueueKey::new(&vhost, q)))
            .collect();
        drop(std::mem::replace(&mut previous, interests));
        assert!(t.wait_synced(&vhost, Duration::from_secs(10)).await);
        let conns = futures::future::join_all((0..100).map(|n| {
            let (uri, queue) = (uri.clone(), queues[n % 10].clone());
            async move {
                let conn = Connection::connect(&uri, ConnectionProperties::default()).await.unwrap();
                let ch = conn.create_channel().await.unwrap();
                let durable = QueueDeclareOptions { durable: true, ..Default::default() };
                ch.queue_declare(queue.as_str().into(), durable, FieldTable::default()).await.unwrap();
                let consumer = ch
                    .basic_consume(
                        queue.as_str().into(),
                        "c".into(),
                        BasicConsumeOptions::default(),
                        FieldTable::default(),
                    )
                    .await
                    .unwrap();
                (conn, ch, consumer)
            }
        }))
        .await;
        let all_seen = eventually(Duration::from_secs(15), || async { t.footprint().0.consumers == 100 });
        assert!(all_seen.await, "wave {wave}: {:?}", t.footprint());
        let (held, vhosts, watched) = t.footprint();
        assert!(held.connections <= 100 && held.channels <= 100, "wave {wave}: {held:?}");
        assert_eq!((vhosts, watched), (1, 20), "wave {wave}");
        // Channel first, answered, then the connection (lapin's own close of a dropped channel
        // would race the connection's); the consumer only after its channel closed, or the
        // cancel lapin sends for a dropped consumer races the close (and can cost the
        // connection).
        futures::future::join_all(conns.into_iter().map(|(conn, ch, consumer)| async move {
            ch.close(200, "bye".into()).await.unwrap();
            drop(consumer);
            conn.close(200, "bye".into()).await.unwrap();
        }))
        .await;
        let all_gone = eventually(Duration::from_secs(15), || async {
            let (held, _, _) = t.footprint();
            held.connections == 0 && held.channels == 0 && held.consumers == 0
        });
        assert!(all_gone.await, "wave {wave}: {:?}", t.footprint());
    }
    drop(previous);
    assert_eq!(t.footprint(), empty, "every policy gone: the tracker holds what it held before");
    mgmt_delete(&format!("vhosts/{}", enc(&vhost))).await;
}

/// A client killed mid-consume (its TCP connection simply gone: no basic.cancel, no close) is
/// detached at once. RabbitMQ 3.13 and later send `consumer.deleted` only for an explicit
/// cancel, so on those brokers this rests on `channel.closed` and `connection.closed`; the suite
/// runs it against 3.10 and 4.0.
#[tokio::test]
async fn a_killed_clients_consumer_leaves_without_a_cancel() {
    let Tracked { t, name, key, mut rx, _interest } = tracked("killed").await;
    let proxy = Proxy::start(&broker_addr()).await;
    let conn = Connection::connect(&proxy.uri(), ConnectionProperties::default()).await.unwrap();
    let ch = conn.create_channel().await.unwrap();
    let _consumer = ch
        .basic_consume(name.as_str().into(), "doomed".into(), BasicConsumeOptions::default(), FieldTable::default())
        .await
        .unwrap();
    assert!(matches!(next_change_on(&mut rx, &key, Duration::from_secs(3)).await, Some(Change::Attached { .. })));
    let killed = std::time::Instant::now();
    proxy.cut();
    let left = next_change_on(&mut rx, &key, Duration::from_secs(3)).await;
    assert!(matches!(&left, Some(Change::Detached { consumer }) if consumer.tag == "doomed"), "{left:?}");
    eprintln!("detached {:?} after the client's connection was cut", killed.elapsed());
    assert!(t.consumers_on(&key).is_empty());
    delete_queues(&[&name]).await;
}
