//! The swap: the emptied queue deleted once nothing can be lost with it, and declared again
//! with its new shape.
//!
//! Two things can be lost with a deleted queue: deliveries its consumers have not acknowledged
//! (requeued later, by a consumer that fails, they would have nowhere to go), and a publish that
//! reaches it while the broker deletes it (RabbitMQ confirms it and drops it with the queue,
//! fenced or not: the fence refuses only what the queue process handles before it stops). So a
//! mover consumes the queue above every other consumer, and from then on the queue delivers to
//! nobody else: what the others hold can only go down. Their count is known only from the
//! queue's statistics, emitted every few seconds; a fence policy of this attempt's own name
//! marks those emitted after the mover took over, and the first such emission that shows
//! nothing unacknowledged settles it. The mover also sees, as they come, the publishes that
//! reach the queue through the default exchange; once a second passes without one, the fence
//! closes (publishes are refused, retried by publishers with confirms), the mover stops, and the
//! queue is deleted once empty.

use super::{
    Bounds, Error, Fence, Shape, Target, above, fence,
    mover::{self, Mover, Moving},
    run::{applying, durable, field_table, lift_fences, ready_on},
    waiting_settings,
};
use crate::broker::{Broker, amqp::AmqpError, refusal::PRECONDITION_FAILED};
use lapin::options::QueueDeleteOptions;
use std::{
    sync::atomic::{AtomicU64, Ordering},
    time::{Duration, Instant},
};

/// Attempts at deleting the emptied queue before giving up for this pass: each failed one
/// (messages published to it meanwhile through the default exchange) drains it again.
const SWAP_ATTEMPTS: usize = 20;
/// A moment for the fence to reach a queue on another node.
const FENCE_SETTLE: Duration = Duration::from_millis(100);
/// How long the mover moves between two looks at the queue's statistics.
const LOOK_EVERY: Duration = Duration::from_millis(250);
/// A pause in what reaches the queue this long lets the swap go ahead.
const QUIET: Duration = Duration::from_secs(1);

/// What a swap did.
#[derive(Debug, Default)]
pub struct Swapped {
    pub moved_out: u64,
    /// From the deletion to the new queue's declare-ok.
    pub window: Option<Duration>,
    /// How long the closed fence refused publishes.
    pub fenced: Option<Duration>,
    /// Messages the broker reported deleted with the old queue: a quorum queue cannot be
    /// deleted if-empty, and its fence lets one publish of a new publisher through while it is
    /// empty, so one arriving between the last look and the deletion is lost, and counted.
    pub dropped: u32,
}

/// Swaps `target.queue` for a new one of its target shape, moving what it still receives into
/// `holding`. On error, also returns how many messages were moved before it.
pub async fn swap(broker: &Broker, target: &Target, holding: &str, bounds: &Bounds) -> Result<Swapped, (Error, u64)> {
    let moved = AtomicU64::new(0);
    let result = swap_counted(broker, target, holding, bounds, &moved).await;
    result.map_err(|e| (e, moved.load(Ordering::Relaxed)))
}

async fn swap_counted(
    broker: &Broker,
    target: &Target,
    holding: &str,
    bounds: &Bounds,
    moved: &AtomicU64,
) -> Result<Swapped, Error> {
    let (vhost, queue) = (broker.vhost(), target.queue.as_str());
    // A fence of an earlier attempt would pass for this one's in the statistics.
    lift_fences(broker, queue).await?;
    let Some(info) = broker.management.queue(vhost, queue).await? else {
        // An earlier attempt deleted the queue and was cut off before it declared it again.
        let started = Instant::now();
        declare(broker, target).await?;
        return Ok(Swapped { window: Some(started.elapsed()), ..Default::default() });
    };
    let current = Shape::of(&info);
    let policies = broker.management.policies(vhost, Duration::ZERO).await?;
    let applying = applying(queue, &current.queue_type, &policies);
    let attempt = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_millis();
    let fence = fence(queue, &current, &waiting_settings(&current, applying), above(&policies), attempt as u64);

    let mut mover = Mover::attach(broker, queue, holding, Moving { first: true, stall: bounds.stall }, moved).await?;
    let quiet = quiesce(broker, queue, &fence, &mut mover, moved, bounds.unacknowledged).await;
    let fenced_from = match quiet {
        Ok(closed_at) => closed_at,
        Err(e) => {
            let _ = mover.stop().await;
            lift_fences(broker, queue).await?;
            return Err(e);
        }
    };
    let stopped = mover.stop().await;
    if let Err(e) = stopped {
        lift_fences(broker, queue).await?;
        return Err(e);
    }
    let mut swapped = delete_and_declare(broker, target, holding, fence.closed.is_some(), moved, bounds).await?;
    swapped.moved_out = moved.load(Ordering::Relaxed);
    if fence.closed.is_some() {
        swapped.fenced = Some(fenced_from.elapsed());
    }
    Ok(swapped)
}

/// Puts the fence up (ready, refusing nothing) and moves what the queue receives until
/// statistics emitted with it in force show no unacknowledged delivery, and nothing has reached
/// the queue for [`QUIET`]: a publish through the default exchange that reaches a queue as the
/// broker deletes it is confirmed and dropped with it (RabbitMQ's behaviour, for any fence), so
/// the deletion waits for a pause in them. Then closes the fence and returns when it did.
async fn quiesce(
    broker: &Broker,
    queue: &str,
    fence: &Fence,
    mover: &mut Mover<'_>,
    moved: &AtomicU64,
    bound: Duration,
) -> Result<Instant, Error> {
    let (management, vhost) = (&broker.management, broker.vhost());
    let started = Instant::now();
    management.put_policy(vhost, &fence.ready).await?;
    let moved_at_start = moved.load(Ordering::Relaxed);
    let mut last_arrival = started;
    // Once statistics emitted after the mover took over show nothing held, nothing is: the
    // queue delivers to nobody else from then on.
    let mut nothing_held = false;
    let mut held = None;
    loop {
        let before = moved.load(Ordering::Relaxed);
        if mover.take(LOOK_EVERY).await? {
            return Err(Error::Failed(format!("queue '{queue}' was deleted by someone else during its swap")));
        }
        if moved.load(Ordering::Relaxed) > before {
            last_arrival = Instant::now();
        }
        if !nothing_held {
            let info = management
                .queue(vhost, queue)
                .await?
                .ok_or_else(|| Error::Failed(format!("queue '{queue}' was deleted by someone else during its swap")))?;
            if Fence::shown_in(&info, &fence.ready) {
                match info.messages_unacknowledged {
                    Some(0) => nothing_held = true,
                    unacknowledged => held = unacknowledged,
                }
            }
        }
        let quiet = last_arrival.elapsed() >= QUIET;
        if nothing_held && quiet {
            break;
        }
        if started.elapsed() > bound {
            let queue = queue.to_owned();
            // Never a quiet second: the publishers kept it (while they publish, the mover's own
            // deliveries in flight count as unacknowledged too); quiet, the deliveries held did.
            return Err(if quiet {
                Error::Unacknowledged { queue, unacknowledged: held.unwrap_or_default(), waited: bound }
            } else {
                Error::Publishing { queue, publishes: moved.load(Ordering::Relaxed) - moved_at_start, waited: bound }
            });
        }
    }
    let closed_at = Instant::now();
    if let Some(closed) = &fence.closed {
        management.put_policy(vhost, closed).await?;
        tokio::time::sleep(FENCE_SETTLE).await;
    }
    // What reached the queue before the fence took hold.
    mover.take(LOOK_EVERY).await?;
    Ok(closed_at)
}

/// Deletes the queue once empty (draining what still arrives) and declares it with its new
/// shape. The fence is lifted before a quorum queue is declared: on 3.10 a quorum queue
/// declared under it keeps refusing, after the fence is gone, every publisher that met it
/// (measured). A classic one is declared under it, in the same breath as the deletion, so a
/// publish in between is refused rather than returned as unroutable.
async fn delete_and_declare(
    broker: &Broker,
    target: &Target,
    holding: &str,
    fenced: bool,
    moved: &AtomicU64,
    bounds: &Bounds,
) -> Result<Swapped, Error> {
    let queue = target.queue.as_str();
    let arguments = field_table(&target.declare_arguments());
    let classic_source =
        broker.management.queue(broker.vhost(), queue).await?.is_none_or(|q| Shape::of(&q).queue_type == "classic");
    let at_once = fenced && target.queue_type.as_str() == "classic";
    for _ in 0..SWAP_ATTEMPTS {
        let ch = broker.amqp.channel().await?;
        let ready = ready_on(&ch, queue).await?;
        if ready > Some(0) {
            let how = Moving { first: true, stall: bounds.stall };
            mover::drain(broker, queue, holding, how, moved).await?;
            continue;
        }
        // A refused passive declare closed its channel.
        let ch = if ready.is_some() { ch } else { broker.amqp.channel().await? };
        let started = Instant::now();
        let delete = async {
            if ready.is_none() {
                return Ok(0);
            }
            // Quorum queues refuse if-empty: their emptiness was read just before, and what the
            // delete reports is counted.
            let options = QueueDeleteOptions { if_empty: classic_source, ..Default::default() };
            ch.queue_delete(queue.into(), options).await
        };
        let mut window = None;
        let deleted = if at_once {
            let declare = ch.queue_declare(queue.into(), durable(), arguments.clone());
            let both =
                tokio::time::timeout(crate::broker::amqp::OPERATION_TIMEOUT, async { futures::join!(delete, declare) });
            let Ok((deleted, declared)) = both.await else {
                return Err(Error::Failed(format!("no answer from the broker while swapping queue '{queue}'")));
            };
            window = Some(started.elapsed());
            deleted.and_then(|n| declared.map(|_| n))
        } else {
            delete.await
        };
        let dropped = match deleted {
            Ok(dropped) => dropped,
            Err(e) => match broker.amqp.classify(e) {
                // Not empty (messages arrived through the default exchange), or declared again
                // with its old shape by an application in between: drain it and try again.
                AmqpError::Refused(r) if r.code == PRECONDITION_FAILED => {
                    tracing::info!(%queue, reason = %r, "queue not empty at the swap; draining it again");
                    let how = Moving { first: true, stall: bounds.stall };
                    mover::drain(broker, queue, holding, how, moved).await?;
                    continue;
                }
                other => return Err(other.into()),
            },
        };
        lift_fences(broker, queue).await?;
        if !at_once {
            declare(broker, target).await?;
        }
        let window = window.unwrap_or_else(|| started.elapsed());
        if dropped > 0 {
            tracing::warn!(%queue, dropped, "messages raced the swap of a quorum queue and were deleted with it");
        }
        return Ok(Swapped { window: Some(window), dropped, ..Default::default() });
    }
    lift_fences(broker, queue).await?;
    Err(Error::Failed(format!(
        "queue '{queue}' kept receiving messages through the default exchange: it was not empty at {SWAP_ATTEMPTS} attempts to swap it; the next pass tries again"
    )))
}

pub(super) async fn declare(broker: &Broker, target: &Target) -> Result<(), Error> {
    let ch = broker.amqp.channel().await?;
    let arguments = field_table(&target.declare_arguments());
    ch.run(ch.queue_declare(target.queue.as_str().into(), durable(), arguments)).await?;
    Ok(())
}
