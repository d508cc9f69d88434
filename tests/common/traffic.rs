//! Live traffic on a queue for the migration tests: publishers with confirms and `mandatory`
//! that retry what comes back, and consumers that consume again when the broker cancels them,
//! every message counted by its id.

use futures::StreamExt;
use lapin::{
    BasicProperties, Channel, Confirmation, Connection, ConnectionProperties,
    options::{BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions, ConfirmSelectOptions},
    types::FieldTable,
};
use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

/// Where a publisher sends: an exchange and routing key ("" and the queue for the default one).
#[derive(Clone)]
pub struct Route {
    pub exchange: String,
    pub routing_key: String,
    /// Prefix of the message ids it publishes.
    pub tag: &'static str,
    /// It stops publishing this long after it started (None: when told to).
    pub stop_after: Option<Duration>,
}

#[derive(Default)]
struct Counts {
    /// When the broker confirmed each (None: preloaded).
    published: Mutex<HashMap<String, Option<Instant>>>,
    consumed: Mutex<HashMap<String, u32>>,
    returned: AtomicU64,
    refused: AtomicU64,
}

pub struct Traffic {
    counts: Arc<Counts>,
    publishing: Arc<AtomicBool>,
    consuming: Arc<AtomicBool>,
    publishers: Vec<tokio::task::JoinHandle<()>>,
    consumers: Vec<tokio::task::JoinHandle<()>>,
    uri: String,
    queue: String,
    consumer_count: usize,
}

/// A message published (confirmed) and never consumed.
#[derive(Debug)]
pub struct Lost {
    pub id: String,
    pub confirmed_at: Option<Instant>,
}

/// What happened to every message.
#[derive(Debug)]
pub struct Tally {
    pub published: usize,
    pub consumed: usize,
    pub lost: Vec<Lost>,
    pub duplicates: u64,
    /// Publishes the broker returned as unroutable (each retried).
    pub returned: u64,
    /// Publishes the broker refused with a nack (each retried).
    pub refused: u64,
}

async fn connect(uri: &str, name: &str) -> Connection {
    Connection::connect(uri, ConnectionProperties::default().with_connection_name(name.to_owned().into()))
        .await
        .expect("test connection")
}

impl Traffic {
    /// Publishers on `routes` (one message every `every` each) and `consumers` consumers of
    /// `queue`. `preloaded` ids count as published (messages put in the queue beforehand).
    pub async fn start(
        uri: &str,
        queue: &str,
        routes: &[Route],
        consumers: usize,
        every: Duration,
        preloaded: impl IntoIterator<Item = String>,
    ) -> Self {
        let counts = Arc::new(Counts::default());
        counts.published.lock().unwrap().extend(preloaded.into_iter().map(|id| (id, None)));
        let publishing = Arc::new(AtomicBool::new(true));
        let consuming = Arc::new(AtomicBool::new(true));
        let mut traffic = Self {
            counts,
            publishing,
            consuming,
            publishers: Vec::new(),
            consumers: Vec::new(),
            uri: uri.to_owned(),
            queue: queue.to_owned(),
            consumer_count: consumers,
        };
        for route in routes {
            let conn = connect(uri, "qgt-publisher").await;
            let (counts, running, route) = (traffic.counts.clone(), traffic.publishing.clone(), route.clone());
            traffic.publishers.push(tokio::spawn(async move { publish(conn, route, every, counts, running).await }));
        }
        for i in 0..consumers {
            let conn = connect(uri, &format!("qgt-consumer-{i}")).await;
            let (counts, running, queue) = (traffic.counts.clone(), traffic.consuming.clone(), queue.to_owned());
            traffic.consumers.push(tokio::spawn(async move { consume(conn, queue, counts, running).await }));
        }
        traffic
    }

    /// Stops the consumers and starts new ones, as the operator's restart of the consumer
    /// workload does after a migration: a consumer that re-consumed while the old queue was
    /// being deleted can be left attached to nothing, idle.
    pub async fn restart_consumers(&mut self) {
        self.consuming.store(false, Ordering::SeqCst);
        for c in self.consumers.drain(..) {
            c.await.unwrap();
        }
        self.consuming.store(true, Ordering::SeqCst);
        for i in 0..self.consumer_count {
            let conn = connect(&self.uri, &format!("qgt-consumer-{i}")).await;
            let (counts, running, queue) = (self.counts.clone(), self.consuming.clone(), self.queue.clone());
            self.consumers.push(tokio::spawn(async move { consume(conn, queue, counts, running).await }));
        }
    }

    pub fn published(&self) -> usize {
        self.counts.published.lock().unwrap().len()
    }

    /// Stops the publishers and returns the ids the broker confirmed (routed, not returned),
    /// with the publishes it returned and refused; the consumers go on.
    pub async fn stop_publishing(&mut self) -> (Vec<String>, u64, u64) {
        self.publishing.store(false, Ordering::SeqCst);
        for p in self.publishers.drain(..) {
            p.await.unwrap();
        }
        let mut ids: Vec<String> = self.counts.published.lock().unwrap().keys().cloned().collect();
        ids.sort();
        (ids, self.counts.returned.load(Ordering::SeqCst), self.counts.refused.load(Ordering::SeqCst))
    }

    /// Stops publishing, waits (up to `within`) until every published message was consumed,
    /// stops the consumers and counts.
    pub async fn finish(mut self, within: Duration) -> Tally {
        self.publishing.store(false, Ordering::SeqCst);
        for p in self.publishers.drain(..) {
            p.await.unwrap();
        }
        let counts = self.counts.clone();
        let all_consumed = || {
            let consumed = counts.consumed.lock().unwrap();
            counts.published.lock().unwrap().keys().all(|id| consumed.contains_key(id))
        };
        let deadline = tokio::time::Instant::now() + within;
        while !all_consumed() && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        self.consuming.store(false, Ordering::SeqCst);
        for c in self.consumers.drain(..) {
            c.await.unwrap();
        }
        let consumed = counts.consumed.lock().unwrap();
        let published = counts.published.lock().unwrap();
        let mut lost: Vec<Lost> = published
            .iter()
            .filter(|(id, _)| !consumed.contains_key(*id))
            .map(|(id, at)| Lost { id: id.clone(), confirmed_at: *at })
            .collect();
        lost.sort_by(|a, b| a.id.cmp(&b.id));
        Tally {
            published: published.len(),
            consumed: consumed.len(),
            lost,
            duplicates: consumed.values().map(|n| u64::from(n - 1)).sum(),
            returned: counts.returned.load(Ordering::SeqCst),
            refused: counts.refused.load(Ordering::SeqCst),
        }
    }
}

async fn publish(conn: Connection, route: Route, every: Duration, counts: Arc<Counts>, running: Arc<AtomicBool>) {
    let mut seq = 0u64;
    let mut ch: Option<Channel> = None;
    let started = Instant::now();
    while running.load(Ordering::SeqCst) && route.stop_after.is_none_or(|d| started.elapsed() < d) {
        if ch.as_ref().is_none_or(|c| !c.status().connected()) {
            let fresh = conn.create_channel().await.expect("publisher channel");
            fresh.confirm_select(ConfirmSelectOptions::default()).await.expect("confirms");
            ch = Some(fresh);
        }
        let channel = ch.as_ref().unwrap();
        let id = format!("{}-{seq}", route.tag);
        let sent = channel
            .basic_publish(
                route.exchange.as_str().into(),
                route.routing_key.as_str().into(),
                BasicPublishOptions { mandatory: true, ..Default::default() },
                id.as_bytes(),
                BasicProperties::default().with_delivery_mode(2).with_message_id(id.as_str().into()),
            )
            .await;
        let confirmed = match sent {
            Ok(confirm) => confirm.await.ok(),
            Err(_) => None,
        };
        match confirmed {
            Some(Confirmation::Ack(None)) => {
                counts.published.lock().unwrap().insert(id, Some(Instant::now()));
                seq += 1;
            }
            // Returned (no queue by that name for a moment) or refused: the same id again.
            Some(Confirmation::Ack(Some(_))) => {
                counts.returned.fetch_add(1, Ordering::SeqCst);
            }
            Some(Confirmation::Nack(_)) => {
                counts.refused.fetch_add(1, Ordering::SeqCst);
            }
            _ => {}
        }
        tokio::time::sleep(every).await;
    }
    let _ = conn.close(200, "done".into()).await;
}

/// A broker call with a deadline; None when it passed.
async fn within<T>(call: impl std::future::Future<Output = T>) -> Option<T> {
    tokio::time::timeout(Duration::from_secs(5), call).await.ok()
}

async fn consume(conn: Connection, queue: String, counts: Arc<Counts>, running: Arc<AtomicBool>) {
    // Every call has a deadline, as a careful client's: a consume sent while the old queue is
    // being deleted may never be answered (seen on RabbitMQ 4.0).
    while running.load(Ordering::SeqCst) {
        let Some(Ok(ch)) = within(conn.create_channel()).await else { break };
        let _ = within(ch.basic_qos(20, BasicQosOptions::default())).await;
        // The queue may be missing for a moment (the swap): the refusal closes the channel.
        let consumed =
            ch.basic_consume(queue.as_str().into(), "".into(), BasicConsumeOptions::default(), FieldTable::default());
        let Some(Ok(mut deliveries)) = within(consumed).await else {
            let _ = within(ch.close(200, "again".into())).await;
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        while running.load(Ordering::SeqCst) {
            let next = tokio::time::timeout(Duration::from_millis(100), deliveries.next()).await;
            match next {
                Ok(Some(Ok(d))) => {
                    let id = d.properties.message_id().as_ref().map(|s| s.to_string()).unwrap_or_default();
                    *counts.consumed.lock().unwrap().entry(id).or_default() += 1;
                    let _ = within(d.acker.ack(BasicAckOptions::default())).await;
                }
                // Cancelled by the broker (its queue was deleted), or the channel failed.
                Ok(Some(Err(_)) | None) => break,
                Err(_idle) => {}
            }
        }
        let _ = within(ch.close(200, "again".into())).await;
    }
    let _ = within(conn.close(200, "done".into())).await;
}
