//! The cost of changing a queue's type live: the operator's mover against the floor, a plain
//! lapin loop that consumes, publishes with confirms and acknowledges after the confirm (the
//! same prefetch and confirm batches, on its own connection), each moving the same number of
//! 1 KiB persistent messages from a classic queue into a quorum queue (what a migration to
//! quorum does twice: into the holding queue and back). Runs alternate (floor, mover, mover,
//! floor), so drift on a shared machine falls on both. Then 20 whole migrations of a small
//! queue, classic and quorum in turn, for the swap window (the queue's name without a queue) and
//! the fence around it.
//!
//! `cargo bench --bench migrate` against the local broker (QUEUEGUARD_BENCH_BROKER,
//! QUEUEGUARD_BENCH_MANAGEMENT, QUEUEGUARD_BENCH_MESSAGES, default 100000). Ends with one
//! `key=value` summary line.

use futures::StreamExt;
use lapin::{
    BasicProperties, Connection, ConnectionProperties, PublisherConfirm,
    options::*,
    types::{AMQPValue, FieldTable},
};
use queueguard::{
    broker::{Broker, BrokerPool, uri::BrokerUri},
    crd::{MigrationStatus, QueueType},
    migrate::{
        Bounds, Target,
        mover::{self, Moving},
        run::{Ended, Journal, migrate},
    },
};
use std::{
    collections::VecDeque,
    sync::atomic::AtomicU64,
    time::{Duration, Instant},
};

const BODY: usize = 1024;
/// As the mover's: deliveries in flight, and confirms awaited per batch.
const PREFETCH: u16 = 2000;
const BATCH: usize = 500;
const SWAPS: usize = 20;

fn env(key: &str, default: &str) -> String {
    std::env::var(key).unwrap_or_else(|_| default.to_owned())
}

fn arguments(queue_type: &str) -> FieldTable {
    let mut args = FieldTable::default();
    args.insert("x-queue-type".into(), AMQPValue::LongString(queue_type.into()));
    args
}

async fn declare(conn: &Connection, queue: &str, queue_type: &str) {
    let ch = conn.create_channel().await.unwrap();
    let options = QueueDeclareOptions { durable: true, ..Default::default() };
    ch.queue_declare(queue.into(), options, arguments(queue_type)).await.unwrap();
    ch.close(200, "ok".into()).await.unwrap();
}

async fn delete(conn: &Connection, queue: &str) {
    let ch = conn.create_channel().await.unwrap();
    ch.queue_delete(queue.into(), QueueDeleteOptions::default()).await.unwrap();
    ch.close(200, "ok".into()).await.unwrap();
}

/// Publishes `n` persistent 1 KiB messages into `queue` with confirms, in batches.
async fn fill(conn: &Connection, queue: &str, n: usize) {
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default()).await.unwrap();
    let body = vec![b'x'; BODY];
    let mut pending = Vec::with_capacity(BATCH);
    for i in 0..n {
        let props = BasicProperties::default().with_delivery_mode(2).with_message_id(i.to_string().into());
        pending.push(
            ch.basic_publish("".into(), queue.into(), BasicPublishOptions::default(), &body, props).await.unwrap(),
        );
        if pending.len() == BATCH || i + 1 == n {
            for confirm in pending.drain(..) {
                assert!(confirm.await.unwrap().is_ack(), "the broker confirmed every message of the fill");
            }
        }
    }
    ch.close(200, "ok".into()).await.unwrap();
}

/// The floor: consume from `from`, publish each into `to` with confirms, acknowledge what the
/// confirms cover, until `n` are moved.
async fn raw_move(conn: &Connection, from: &str, to: &str, n: usize) -> usize {
    let consume = conn.create_channel().await.unwrap();
    let publish = conn.create_channel().await.unwrap();
    publish.confirm_select(ConfirmSelectOptions::default()).await.unwrap();
    consume.basic_qos(PREFETCH, BasicQosOptions::default()).await.unwrap();
    let mut deliveries = consume
        .basic_consume(from.into(), "raw".into(), BasicConsumeOptions::default(), FieldTable::default())
        .await
        .unwrap();
    let mut pending: VecDeque<(u64, PublisherConfirm)> = VecDeque::new();
    let mut moved = 0;
    while moved < n {
        let delivery = deliveries.next().await.expect("deliveries until all are moved").unwrap();
        let confirm = publish
            .basic_publish("".into(), to.into(), BasicPublishOptions::default(), &delivery.data, delivery.properties)
            .await
            .unwrap();
        pending.push_back((delivery.delivery_tag, confirm));
        if pending.len() >= BATCH || moved + pending.len() == n {
            let mut last = 0;
            while let Some((tag, confirm)) = pending.pop_front() {
                assert!(confirm.await.unwrap().is_ack());
                last = tag;
                moved += 1;
            }
            consume.basic_ack(last, BasicAckOptions { multiple: true }).await.unwrap();
        }
    }
    consume.close(200, "ok".into()).await.unwrap();
    publish.close(200, "ok".into()).await.unwrap();
    moved
}

/// Messages a second.
fn rate(n: usize, took: Duration) -> f64 {
    n as f64 / took.as_secs_f64()
}

/// Records nothing: the benchmark reads the final state.
struct Unrecorded;

impl Journal for Unrecorded {
    async fn record(&mut self, _: &MigrationStatus) -> Result<(), String> {
        Ok(())
    }
}

/// Migrates `queue` to `to` and returns (swap window, fence) in ms.
async fn swap(broker: &Broker, queue: &str, to: QueueType) -> (i64, i64) {
    let target = Target { queue: queue.into(), queue_type: to, arguments: Default::default() };
    match migrate(broker, &target, None, &mut Unrecorded, &Bounds::default()).await.expect("the migration runs") {
        Ended::Moved(state) => {
            (state.swap_window_millis.expect("a swap window"), state.fenced_millis.expect("a fence"))
        }
        Ended::NotNeeded => panic!("queue '{queue}' was already {to:?}"),
    }
}

fn percentile(sorted: &[i64], p: f64) -> i64 {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

#[tokio::main]
async fn main() {
    queueguard::tls::install_crypto_provider();
    let broker_uri = env("QUEUEGUARD_BENCH_BROKER", "amqp://guest:guest@127.0.0.1:5672/%2F");
    let management = env("QUEUEGUARD_BENCH_MANAGEMENT", "http://127.0.0.1:15672");
    let n: usize = env("QUEUEGUARD_BENCH_MESSAGES", "100000").parse().expect("QUEUEGUARD_BENCH_MESSAGES");
    let uri = BrokerUri::parse(&broker_uri, Some(&management)).expect("broker URI");
    let conn = Connection::connect_uri(
        uri.amqp().clone(),
        ConnectionProperties::default().with_connection_name("bench-migrate".into()),
    )
    .await
    .expect("the broker answers");
    let pool = BrokerPool::new("bench-migrate");
    let broker = pool.get(uri.clone(), None).expect("the broker endpoint");
    let base = format!("bench-migrate.{}", std::process::id());
    println!("migrate: {n} messages of {BODY} bytes, classic into quorum, floor and mover alternating");

    let mut floor = Vec::new();
    let mut mover_rates = Vec::new();
    for (round, is_mover) in [false, true, true, false].into_iter().enumerate() {
        let (from, to) = (format!("{base}.{round}.from"), format!("{base}.{round}.to"));
        declare(&conn, &from, "classic").await;
        declare(&conn, &to, "quorum").await;
        fill(&conn, &from, n).await;
        let started = Instant::now();
        let moved = if is_mover {
            let counted = AtomicU64::new(0);
            mover::drain(&broker, &from, &to, Moving { first: false, stall: Bounds::default().stall }, &counted)
                .await
                .expect("the mover moves") as usize
        } else {
            raw_move(&conn, &from, &to, n).await
        };
        let took = started.elapsed();
        assert_eq!(moved, n, "every message moved");
        let r = rate(n, took);
        println!(
            "  {:<5} {moved} in {:.2}s: {r:.0} msg/s",
            if is_mover { "mover" } else { "floor" },
            took.as_secs_f64()
        );
        if is_mover {
            mover_rates.push(r)
        } else {
            floor.push(r)
        }
        delete(&conn, &from).await;
        delete(&conn, &to).await;
    }
    let floor_rate = floor.iter().sum::<f64>() / floor.len() as f64;
    let mover_rate = mover_rates.iter().sum::<f64>() / mover_rates.len() as f64;
    let ratio = mover_rate / floor_rate;
    println!(
        "  mover {mover_rate:.0} msg/s against the floor's {floor_rate:.0}: {ratio:.2} of it (target: at least 0.8)"
    );

    let queue = format!("{base}.swap");
    declare(&conn, &queue, "classic").await;
    fill(&conn, &queue, 100).await;
    let (mut windows, mut fences) = (Vec::new(), Vec::new());
    for i in 0..SWAPS {
        let to = if i % 2 == 0 { QueueType::Quorum } else { QueueType::Classic };
        let (window, fence) = swap(&broker, &queue, to).await;
        windows.push(window);
        fences.push(fence);
    }
    delete(&conn, &queue).await;
    windows.sort();
    fences.sort();
    let (w50, wmax, f50, fmax) =
        (percentile(&windows, 0.5), percentile(&windows, 1.0), percentile(&fences, 0.5), percentile(&fences, 1.0));
    println!("  {SWAPS} swaps of a queue of 100 messages, classic and quorum in turn:");
    println!("    swap window (no queue under the name): p50={w50}ms max={wmax}ms");
    println!("    fence (publishes refused around the swap): p50={f50}ms max={fmax}ms");
    println!(
        "summary messages={n} floor_msgs_per_s={floor_rate:.0} mover_msgs_per_s={mover_rate:.0} ratio={ratio:.2} swaps={SWAPS} swap_window_p50_ms={w50} swap_window_max_ms={wmax} fence_p50_ms={f50} fence_max_ms={fmax}"
    );
    let _ = conn.close(200, "done".into()).await;
}
