//! Moves a queue's messages into another queue: each is published (through the default
//! exchange, with publisher confirms and `mandatory`) and acknowledged on its old queue only
//! once the broker confirmed the copy. A move cut short leaves the unconfirmed ones in their old
//! queue (the broker requeues a closed channel's unacknowledged deliveries): moved again later,
//! never lost; a copy confirmed but not yet acknowledged is moved twice (at-least-once).

use super::Error;
use crate::broker::{Broker, amqp::AmqpError, refusal::ACCESS_REFUSED};
use futures::StreamExt;
use lapin::{
    BasicProperties, Channel, Confirmation, Consumer, PublisherConfirm,
    options::{
        BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
        ConfirmSelectOptions, QueueDeclareOptions,
    },
    types::{AMQPValue, FieldTable},
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

/// How a mover takes its queue's messages.
#[derive(Debug, Clone, Copy)]
pub struct Moving {
    /// Above every other consumer of the queue (`x-priority`): while it has room, the queue
    /// delivers to nobody else, so what the others hold can only go down.
    pub first: bool,
    /// Ready messages and no delivery for this long: the queue does not deliver to the mover
    /// (a single active consumer holds it, say), so the move stops and says so.
    pub stall: Duration,
}

/// A consumer of one queue that copies what it receives into another.
pub struct Mover<'a> {
    broker: &'a Broker,
    from: String,
    to: String,
    generation: u64,
    consume: Channel,
    publish: Channel,
    deliveries: Consumer,
    pending: VecDeque<(u64, PublisherConfirm)>,
    moved: &'a AtomicU64,
    /// Copies confirmed and acknowledged by this mover.
    count: u64,
    last_delivery: Instant,
    stall: Duration,
}

impl<'a> Mover<'a> {
    /// Starts consuming `from`; each confirmed copy is counted in `moved` as it goes.
    pub async fn attach(
        broker: &'a Broker,
        from: &str,
        to: &str,
        how: Moving,
        moved: &'a AtomicU64,
    ) -> Result<Self, Error> {
        let amqp = &broker.amqp;
        let (consume, generation) = amqp.dedicated_channel().await?;
        let (publish, _) = amqp.dedicated_channel().await?;
        let attached = async {
            amqp.run_on(generation, publish.confirm_select(ConfirmSelectOptions::default())).await?;
            amqp.run_on(generation, consume.basic_qos(PREFETCH, BasicQosOptions::default())).await?;
            let mut arguments = FieldTable::default();
            if how.first {
                arguments.insert("x-priority".into(), AMQPValue::LongInt(i32::MAX));
            }
            amqp.run_on(
                generation,
                consume.basic_consume(from.into(), TAG.into(), BasicConsumeOptions::default(), arguments),
            )
            .await
        }
        .await;
        let deliveries = match attached {
            Ok(d) => d,
            Err(e) => {
                close(&[&consume, &publish]).await;
                return Err(match e {
                    AmqpError::Refused(r) if r.code == ACCESS_REFUSED => Error::Refused(format!(
                        "queue '{from}' cannot be consumed by queueguard ({r}): an exclusive consumer holds it"
                    )),
                    other => other.into(),
                });
            }
        };
        Ok(Self {
            broker,
            from: from.to_owned(),
            to: to.to_owned(),
            generation,
            consume,
            publish,
            deliveries,
            pending: VecDeque::new(),
            moved,
            count: 0,
            last_delivery: Instant::now(),
            stall: how.stall,
        })
    }

    /// Copies what arrives for up to `within` (less once deliveries pause for [`IDLE`]), and
    /// acknowledges every copy the broker confirmed. Returns whether the queue cancelled the
    /// consumer (it was deleted).
    pub async fn take(&mut self, within: Duration) -> Result<bool, Error> {
        let until = Instant::now() + within;
        let mut cancelled = false;
        while Instant::now() < until {
            match tokio::time::timeout(IDLE, self.deliveries.next()).await {
                Ok(Some(Ok(delivery))) => {
                    self.last_delivery = Instant::now();
                    let copy = copy(self.broker, &self.publish, &self.to, delivery).await?;
                    self.pending.push_back(copy);
                    if self.pending.len() >= BATCH {
                        self.settle().await?;
                    }
                }
                Ok(Some(Err(e))) => return Err(self.broker.amqp.classify(e).into()),
                // The broker cancelled the consumer: the queue is gone.
                Ok(None) => {
                    cancelled = true;
                    break;
                }
                Err(_idle) => break,
            }
        }
        self.settle().await?;
        Ok(cancelled)
    }

    /// The queue's ready messages now (a passive declare on the publishing channel, immediate,
    /// unlike management statistics). A queue that holds some while nothing has been delivered
    /// to the mover for its stall bound stops the move.
    pub async fn look(&self) -> Result<u32, Error> {
        let ready = ready(&self.publish, &self.from).await?;
        if ready > 0 && self.last_delivery.elapsed() > self.stall {
            return Err(Error::Stalled { queue: self.from.clone(), ready, stalled: self.stall });
        }
        Ok(ready)
    }

    /// Stops consuming: cancels, takes what the broker had already sent (those deliveries are
    /// neither ready nor moved; closing the channel would put them back after the queue was
    /// seen empty), settles, closes. Returns how many this mover moved.
    pub async fn stop(mut self) -> Result<u64, Error> {
        let result = async {
            let cancel = self.consume.basic_cancel(TAG.into(), BasicCancelOptions::default());
            self.broker.amqp.run_on(self.generation, cancel).await?;
            while let Ok(Some(Ok(delivery))) = tokio::time::timeout(IDLE, self.deliveries.next()).await {
                let copy = copy(self.broker, &self.publish, &self.to, delivery).await?;
                self.pending.push_back(copy);
            }
            self.settle().await
        }
        .await;
        // Unacknowledged deliveries go back to `from` with the channel.
        close(&[&self.consume, &self.publish]).await;
        result.map(|()| self.count)
    }

    /// Awaits the confirms in flight, oldest first, and acknowledges what they cover at once
    /// (also when a later one failed, so those are not moved twice).
    async fn settle(&mut self) -> Result<(), Error> {
        let mut last = None;
        let mut count = 0u64;
        let mut failure = None;
        while let Some((tag, confirm)) = self.pending.pop_front() {
            match confirmed(confirm, &self.to).await {
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
            self.consume
                .basic_ack(tag, BasicAckOptions { multiple: true })
                .await
                .map_err(|e| Error::Failed(format!("acknowledging moved messages: {e}")))?;
            self.moved.fetch_add(count, Ordering::Relaxed);
            self.count += count;
        }
        failure.map_or(Ok(()), Err)
    }
}

async fn close(channels: &[&Channel]) {
    for ch in channels {
        let _ = tokio::time::timeout(Duration::from_secs(5), ch.close(200, "moved".into())).await;
    }
}

/// Moves every message of `from` into `to` until `from` holds no ready message and nothing is
/// in flight; counts each confirmed copy in `moved` as it goes (for status and metrics) and
/// returns how many it moved. Consumers of `from` keep consuming meanwhile unless the mover goes
/// first: what they take is theirs.
pub async fn drain(broker: &Broker, from: &str, to: &str, how: Moving, moved: &AtomicU64) -> Result<u64, Error> {
    let mut mover = Mover::attach(broker, from, to, how, moved).await?;
    let result = async {
        // Publishes through the default exchange may keep coming while it moves, so it stops at
        // a look that finds nothing ready after a pause, or at the second such look in a row:
        // the deliveries on their way at the first have arrived by then. What comes later is
        // the swap's to move.
        let mut winding_down = false;
        loop {
            let started = Instant::now();
            if mover.take(LOOK_EVERY).await? {
                return Ok(());
            }
            let paused = started.elapsed() < LOOK_EVERY;
            let empty = mover.look().await? == 0;
            if empty && (paused || winding_down) {
                return Ok(());
            }
            winding_down = empty;
        }
    }
    .await;
    match result {
        Ok(()) => mover.stop().await,
        Err(e) => {
            let _ = mover.stop().await;
            Err(e)
        }
    }
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
