//! The broker side of the findings: one look at the queue, its dead-letter queue and its
//! consumers. The vhost's queue listing (shared by every policy of the vhost), the consumer
//! tracker, and one passive exchange declare (for the round trip), none of which renews the
//! queue's expiry lease.

use super::{ConsumerView, Sample};
use crate::{
    broker::{
        Broker,
        listing::Want,
        management::{ManagementError, QueueInfo},
    },
    consumers::{ConsumerTracker, QueueKey},
    crd::StatsSource,
};
use k8s_openapi::jiff::{Timestamp, civil::DateTime, tz::TimeZone};
use lapin::{ExchangeKind, options::ExchangeDeclareOptions, types::FieldTable};
use std::time::{Duration, Instant};

/// Why the queue could not be looked at.
#[derive(Debug, thiserror::Error)]
pub enum LookError {
    #[error(transparent)]
    Management(#[from] ManagementError),
    #[error("queue '{0}' not found")]
    QueueMissing(String),
}

/// The queue and its dead-letter queue, by name.
#[derive(Debug, Clone, Copy)]
pub struct Queues<'a> {
    pub queue: &'a str,
    pub dead_letter_queue: &'a str,
}

/// Looks at the queue, in a listing of its vhost read at most `fresh_within` before.
pub async fn sample(
    queues: Queues<'_>,
    broker: &Broker,
    tracker: Option<&ConsumerTracker>,
    fresh_within: Duration,
) -> Result<Sample, LookError> {
    let vhost = broker.vhost().to_owned();
    let want = Want::Queues(&[queues.queue, queues.dead_letter_queue]);
    let listing = broker.management.queues_holding(&vhost, queues.queue, want, fresh_within).await?;
    let queue: &QueueInfo =
        listing.queues.get(queues.queue).ok_or_else(|| LookError::QueueMissing(queues.queue.to_owned()))?;
    let dead_letter = listing.queues.get(queues.dead_letter_queue);
    let consumers: Vec<ConsumerView> = match tracker {
        Some(t) => t
            .consumers_on(&QueueKey::new(&vhost, queues.queue))
            .into_iter()
            .map(|c| ConsumerView {
                peer: c.peer_host.clone().unwrap_or_else(|| c.channel.clone()),
                tag: c.tag,
                prefetch: c.prefetch,
                ack_required: c.ack_required,
            })
            .collect(),
        None => broker
            .management
            .consumers_in(&vhost)
            .await?
            .into_iter()
            .filter(|c| c.queue.name == queues.queue)
            .map(|c| ConsumerView {
                peer: c.channel_details.peer_host.clone().unwrap_or_else(|| c.channel_details.name.clone()),
                tag: c.consumer_tag,
                prefetch: c.prefetch_count,
                ack_required: c.ack_required,
            })
            .collect(),
    };
    let ready = queue.messages_ready.unwrap_or_default();
    let idle_since = match listing.source {
        StatsSource::Management => queue.idle_since.clone(),
        // Not among rabbitmq_prometheus's counters: read for the one queue that could expire
        // with messages in it (ExpiryRisk), which is rare.
        StatsSource::Prometheus if ready > 0 && consumers.is_empty() => {
            broker.management.idle_since(&vhost, queues.queue).await?
        }
        StatsSource::Prometheus => None,
    };
    Ok(Sample {
        // The counters' time: the listing's, however long it was shared.
        now_ms: listing.read_at_ms,
        consumers,
        ready,
        unacked: queue.messages_unacknowledged.unwrap_or_default(),
        acks: queue.message_stats.ack,
        redeliveries: queue.message_stats.redeliver,
        source: listing.source,
        idle_since_ms: idle_since.as_deref().and_then(parse_broker_time),
        dead_letter_ready: dead_letter.and_then(|q| q.messages_ready),
        round_trip_ms: round_trip(broker).await,
    })
}

/// One AMQP round trip: a passive declare of a built-in exchange.
async fn round_trip(broker: &Broker) -> Option<f64> {
    let channel = broker.amqp.channel().await.ok()?;
    let started = Instant::now();
    let options = ExchangeDeclareOptions { passive: true, ..Default::default() };
    channel
        .run(channel.exchange_declare("amq.direct".into(), ExchangeKind::Direct, options, FieldTable::default()))
        .await
        .ok()?;
    Some(started.elapsed().as_secs_f64() * 1000.0)
}

/// The management API's `idle_since`: `2026-12-03 7:41:20` in the broker's time zone (UTC in
/// the usual container), or RFC 3339 in newer versions.
pub fn parse_broker_time(text: &str) -> Option<i64> {
    if let Ok(t) = text.parse::<Timestamp>() {
        return Some(t.as_millisecond());
    }
    let dt = DateTime::strptime("%Y-%m-%d %H:%M:%S", text).ok()?;
    Some(dt.to_zoned(TimeZone::UTC).ok()?.timestamp().as_millisecond())
}

#[cfg(test)]
mod tests {
    #[test]
    fn broker_times_parse_in_both_forms() {
        assert_eq!(super::parse_broker_time("2026-12-03 7:41:20"), Some(1_796_283_680_000));
        assert_eq!(super::parse_broker_time("2026-12-03T07:41:20Z"), Some(1_796_283_680_000));
        assert_eq!(super::parse_broker_time("yesterday"), None);
    }
}
