//! Moves a queue's messages into another queue: each is published (through the default
//! exchange, with publisher confirms and `mandatory`) and acknowledged on its old queue only
//! once the broker confirmed the copy. A move cut short leaves the unconfirmed ones in their old
//! queue (the broker requeues a closed channel's unacknowledged deliveries): moved again later,
//! never lost; a copy confirmed but not yet acknowledged is moved twice (at-least-once).

use super::Error;
use crate::broker::{Broker, amqp::AmqpError};
use futures::StreamExt;
use lapin::{
    BasicProperties, Channel, Confirmation, PublisherConfirm,
    options::{
        BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
        ConfirmSelectOptions, QueueDeclareOptions,
    },
    types::FieldTable,
};
use std::{
    collections::VecDeque,
    sync::atomic::{AtomicU64, Ordering},
    time::{Duration, Instant},
};

/// Deliveries in flight from the old queue: enough to keep the broker's confirms streaming.
const PREFETCH: u16 = 2000;
/// Confirms awaited, and acknowledgements sent, in batches of this many.
const BATCH: usize = 500;
/// A pause this long in deliveries makes the mover ask whether the queue is empty.
const IDLE: Duration = Duration::from_millis(100);
/// ...and so does this much time moving.
const LOOK_EVERY: Duration = Duration::from_millis(500);
/// The mover's consumer tag on the queue it empties.
const TAG: &str = "queueguard-migrate";

/// Moves every message of `from` into `to` until `from` holds no ready message and nothing is
/// in flight; counts each confirmed copy in `moved` as it goes (for status and metrics) and
/// returns how many it moved. Consumers of `from` keep consuming meanwhile: what they take is
/// theirs.
pub async fn drain(broker: &Broker, from: &str, to: &str, moved: &AtomicU64) -> Result<u64, Error> {
    let amqp = &broker.amqp;
    let (consume, generation) = amqp.dedicated_channel().await?;
    let (publish, _) = amqp.dedicated_channel().await?;
    let result = async {
        amqp.run_on(generation, publish.confirm_select(ConfirmSelectOptions::default())).await?;
        amqp.run_on(generation, consume.basic_qos(PREFETCH, BasicQosOptions::default())).await?;
        let mut deliveries = amqp
            .run_on(
                generation,
                consume.basic_consume(from.into(), TAG.into(), BasicConsumeOptions::default(), FieldTable::default()),
            )
            .await?;
        let mut pending: VecDeque<(u64, PublisherConfirm)> = VecDeque::new();
        let mut count = 0u64;
        // Publishes through the default exchange may keep coming while it moves, so it stops at
        // a look that finds nothing ready after a pause, or at the second such look in a row:
        // the deliveries on their way at the first have arrived by then. What comes later is
        // the swap's to move.
        let mut looked = Instant::now();
        let mut winding_down = false;
        loop {
            let idle = match tokio::time::timeout(IDLE, deliveries.next()).await {
                Ok(Some(Ok(delivery))) => {
                    pending.push_back(copy(broker, &publish, to, delivery).await?);
                    if pending.len() >= BATCH {
                        count += settle(&consume, &mut pending, to, moved).await?;
                    }
                    if looked.elapsed() < LOOK_EVERY {
                        continue;
                    }
                    false
                }
                Ok(Some(Err(e))) => return Err(amqp.classify(e).into()),
                // The broker cancelled the consumer: the queue is gone.
                Ok(None) => {
                    count += settle(&consume, &mut pending, to, moved).await?;
                    return Ok(count);
                }
                Err(_) => true,
            };
            count += settle(&consume, &mut pending, to, moved).await?;
            looked = Instant::now();
            let empty = ready(&publish, from).await? == 0;
            if empty && (idle || winding_down) {
                // Deliveries the broker sent and this loop has not taken yet are neither ready
                // nor moved: closing the channel would put them back in `from` after it was seen
                // empty. Once the cancel is answered, every one of them has arrived.
                amqp.run_on(generation, consume.basic_cancel(TAG.into(), BasicCancelOptions::default())).await?;
                while let Ok(Some(Ok(delivery))) = tokio::time::timeout(IDLE, deliveries.next()).await {
                    pending.push_back(copy(broker, &publish, to, delivery).await?);
                }
                count += settle(&consume, &mut pending, to, moved).await?;
                return Ok(count);
            }
            winding_down = empty;
        }
    }
    .await;
    // Unacknowledged deliveries go back to `from` with the channel.
    for ch in [consume, publish] {
        let _ = tokio::time::timeout(Duration::from_secs(5), ch.close(200, "moved".into())).await;
    }
    result
}

/// Publishes a delivery's copy into `to`; its tag and the confirm to await.
async fn copy(
    broker: &Broker,
    publish: &Channel,
    to: &str,
    delivery: lapin::message::Delivery,
) -> Result<(u64, PublisherConfirm), Error> {
    let confirm = publish
        .basic_publish(
            "".into(),
            to.into(),
            BasicPublishOptions { mandatory: true, ..Default::default() },
            &delivery.data,
            carried(&delivery.properties),
        )
        .await
        .map_err(|e| broker.amqp.classify(e))?;
    Ok((delivery.delivery_tag, confirm))
}

/// Awaits the confirms in flight, oldest first, and acknowledges what they cover at once (also
/// when a later one failed, so those are not moved twice).
async fn settle(
    consume: &Channel,
    pending: &mut VecDeque<(u64, PublisherConfirm)>,
    to: &str,
    moved: &AtomicU64,
) -> Result<u64, Error> {
    let mut last = None;
    let mut count = 0u64;
    let mut failure = None;
    while let Some((tag, confirm)) = pending.pop_front() {
        match confirmed(confirm, to).await {
            Ok(()) => {
                last = Some(tag);
                count += 1;
            }
            Err(e) => {
                failure = Some(e);
                break;
            }
        }
    }
    if let Some(tag) = last {
        consume
            .basic_ack(tag, BasicAckOptions { multiple: true })
            .await
            .map_err(|e| Error::Failed(format!("acknowledging moved messages: {e}")))?;
        moved.fetch_add(count, Ordering::Relaxed);
    }
    match failure {
        Some(e) => Err(e),
        None => Ok(count),
    }
}

async fn confirmed(confirm: PublisherConfirm, to: &str) -> Result<(), Error> {
    let confirmation =
        tokio::time::timeout(Duration::from_secs(30), confirm).await.map_err(|_| lost("no publisher confirm"))?;
    match confirmation.map_err(|e| Error::Failed(format!("publishing into '{to}': {e}")))? {
        Confirmation::Ack(None) | Confirmation::NotRequested => Ok(()),
        Confirmation::Ack(Some(_)) => Err(Error::Failed(format!(
            "the broker returned a message as unroutable: queue '{to}' is missing; the message stays where it was"
        ))),
        Confirmation::Nack(_) => Err(Error::Failed(format!(
            "the broker refused a copy into '{to}' (publisher nack); the message stays where it was"
        ))),
    }
}

/// A message's properties as they are carried over: all of them, but for the delivery count a
/// quorum queue adds when it delivers (its own counter, not the message's; the new queue keeps
/// its own).
fn carried(properties: &BasicProperties) -> BasicProperties {
    let Some(headers) = properties.headers().as_ref().filter(|h| h.inner().contains_key("x-delivery-count")) else {
        return properties.clone();
    };
    let mut kept = FieldTable::default();
    for (k, v) in headers.inner().iter().filter(|(k, _)| k.as_str() != "x-delivery-count") {
        kept.insert(k.clone(), v.clone());
    }
    properties.clone().with_headers(kept)
}

fn lost(detail: &str) -> Error {
    Error::Amqp(AmqpError::Lost { endpoint: "broker".into(), detail: detail.into() })
}

/// Ready messages in a queue, by passive declare (immediate, unlike management statistics).
pub async fn ready(ch: &Channel, queue: &str) -> Result<u32, Error> {
    let passive = QueueDeclareOptions { passive: true, ..Default::default() };
    let q =
        tokio::time::timeout(Duration::from_secs(30), ch.queue_declare(queue.into(), passive, FieldTable::default()))
            .await
            .map_err(|_| lost("no answer to a passive declare"))?
            .map_err(|e| Error::Failed(format!("reading queue '{queue}': {e}")))?;
    Ok(q.message_count())
}
