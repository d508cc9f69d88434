//! Carries out a migration on the broker, step by step, each recorded before it is taken.

use super::{Error, Resume, Shape, Target, fence, fence_name, holding_name, mover, refusal, resume_at};
use crate::{
    broker::{
        Broker,
        amqp::{AmqpError, OPERATION_TIMEOUT, PooledChannel},
        management::PolicyInfo,
        refusal::{NOT_FOUND, PRECONDITION_FAILED},
    },
    crd::{MigrationPhase, MigrationStatus, QueueType},
    plan::QueuePlan,
    status::{Check, Reason},
};
use k8s_openapi::{apimachinery::pkg::apis::meta::v1::Time, jiff::Timestamp};
use lapin::{
    options::{QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions},
    types::{AMQPValue, FieldArray, FieldTable},
};
use serde_json::{Map, Value};
use std::{
    sync::atomic::{AtomicU64, Ordering},
    time::{Duration, Instant},
};

/// Attempts at deleting the emptied queue before giving up for this pass: each failed one
/// (messages published to it meanwhile through the default exchange) drains it again.
const SWAP_ATTEMPTS: usize = 20;
/// A moment for the fence to reach a queue on another node.
const FENCE_SETTLE: Duration = Duration::from_millis(50);

/// Where a migration's progress is recorded before each step: status.migration in the
/// cluster, the terminal in local mode. An error stops the migration before that step.
pub trait Journal {
    fn record(&mut self, state: &MigrationStatus) -> impl Future<Output = Result<(), String>> + Send;
}

/// How a pass over a migration ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Ended {
    /// Nothing to migrate: the queue has its target shape (or does not exist yet).
    NotNeeded,
    /// The queue has its new shape, its routes and its messages; the state is not recorded yet
    /// (its phase is RestartingConsumers: the caller restarts them, or says they must be).
    Moved(Box<MigrationStatus>),
}

/// A whole migration of `target.queue` on `broker` (in the broker's vhost), resumed where the
/// broker's state says it stopped. `previous` is the last recorded state (its counts and start
/// carry on).
pub async fn migrate<J: Journal>(
    broker: &Broker,
    target: &Target,
    previous: Option<&MigrationStatus>,
    journal: &mut J,
) -> Result<Ended, Error> {
    let vhost = broker.vhost().to_owned();
    let holding = holding_name(&target.queue);
    let current = broker.management.queue(&vhost, &target.queue).await?.map(|q| Shape::of(&q));
    let held = broker.management.queue(&vhost, &holding).await?.is_some();
    // A record of a migration to another shape (the spec changed midway) says nothing of this one.
    let in_progress = previous.filter(|p| {
        p.queue == target.queue && p.to == target.shape().describe() && p.phase < MigrationPhase::RestartingConsumers
    });
    let mut state = in_progress.cloned().unwrap_or_default();
    let first = match resume_at(current.as_ref(), held, target, in_progress.map(|p| p.phase)) {
        Resume::NotNeeded => return Ok(Ended::NotNeeded),
        Resume::Start => {
            let current = current.as_ref().expect("Start means the queue exists");
            let flags = match target.queue_type {
                QueueType::Quorum => broker.management.feature_flags().await?,
                QueueType::Classic => None,
            };
            if let Some(why) = refusal(current, target, flags.as_deref()) {
                return Err(Error::Refused(why));
            }
            state = MigrationStatus {
                queue: target.queue.clone(),
                from: current.describe(),
                started_at: Some(Time(Timestamp::now())),
                ..Default::default()
            };
            MigrationPhase::Preparing
        }
        Resume::At(phase) => phase,
    };
    state.queue = target.queue.clone();
    state.to = target.shape().describe();
    state.holding_queue = holding.clone();
    state.started_at = state.started_at.or_else(|| Some(Time(Timestamp::now())));
    if state.from.is_empty() {
        state.from = current.as_ref().map(Shape::describe).unwrap_or_default();
    }

    let mut step = Step { broker, target, holding: &holding, vhost: &vhost, state, journal };
    for phase in [
        MigrationPhase::Preparing,
        MigrationPhase::Draining,
        MigrationPhase::Swapping,
        MigrationPhase::Restoring,
        MigrationPhase::Refilling,
    ] {
        if phase >= first {
            step.take(phase).await?;
        }
    }
    let mut state = step.state;
    state.phase = MigrationPhase::RestartingConsumers;
    state.message = format!("queue '{}' is now {}", target.queue, state.to);
    Ok(Ended::Moved(Box::new(state)))
}

struct Step<'a, J> {
    broker: &'a Broker,
    target: &'a Target,
    holding: &'a str,
    vhost: &'a str,
    state: MigrationStatus,
    journal: &'a mut J,
}

impl<J: Journal> Step<'_, J> {
    async fn take(&mut self, phase: MigrationPhase) -> Result<(), Error> {
        self.state.phase = phase;
        self.state.message = describe(phase, &self.target.queue, self.holding);
        self.journal
            .record(&self.state)
            .await
            .map_err(|detail| Error::NotRecorded { phase: phase.as_str(), detail })?;
        let (queue, holding) = (self.target.queue.as_str(), self.holding);
        match phase {
            MigrationPhase::Preparing => {
                ensure_holding(self.broker, holding, self.target).await?;
                self.reroute(queue, holding).await
            }
            MigrationPhase::Draining => {
                self.state.moved_out += self.drain(queue, holding).await?;
                Ok(())
            }
            MigrationPhase::Swapping => self.swap().await,
            MigrationPhase::Restoring => {
                // A swap cut off before it lifted its fence left it up.
                self.broker.management.delete_policy(self.vhost, &fence_name(queue)).await?;
                self.reroute(holding, queue).await
            }
            MigrationPhase::Refilling => {
                self.state.moved_back += self.drain(holding, queue).await?;
                delete_emptied(self.broker, holding).await.map(drop)
            }
            _ => Ok(()),
        }
    }

    async fn drain(&self, from: &str, to: &str) -> Result<i64, Error> {
        let moved = AtomicU64::new(0);
        let result = mover::drain(self.broker, from, to, &moved).await;
        if result.is_err() {
            tracing::info!(%from, %to, moved = moved.load(Ordering::Relaxed), "move cut short; resumes next pass");
        }
        result.map(|n| n as i64)
    }

    /// Binds `to` wherever either queue is bound from an exchange, then unbinds `from`: a
    /// message routed meanwhile reaches one of them, or both (a duplicate, never a loss).
    async fn reroute(&self, from: &str, to: &str) -> Result<(), Error> {
        let management = &self.broker.management;
        let mut routes = management.queue_bindings(self.vhost, from).await?;
        routes.extend(management.queue_bindings(self.vhost, to).await?);
        routes.retain(|b| !b.source.is_empty());
        let ch = self.broker.amqp.channel().await?;
        for b in &routes {
            ch.run(ch.queue_bind(
                to.into(),
                b.source.as_str().into(),
                b.routing_key.as_str().into(),
                QueueBindOptions::default(),
                field_table(&b.arguments),
            ))
            .await?;
        }
        for b in &routes {
            match ch
                .run(ch.queue_unbind(
                    from.into(),
                    b.source.as_str().into(),
                    b.routing_key.as_str().into(),
                    field_table(&b.arguments),
                ))
                .await
            {
                Ok(()) => {}
                // The queue is gone, and its bindings with it.
                Err(AmqpError::Refused(r)) if r.code == NOT_FOUND => return Ok(()),
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    /// Deletes the emptied queue and declares it again with its new shape, back to back on one
    /// channel. A publish through the default exchange in between is unroutable: the window is
    /// measured. Messages that reached the old queue since it was drained are drained again.
    async fn swap(&mut self) -> Result<(), Error> {
        let queue = self.target.queue.as_str();
        let current = self.broker.management.queue(self.vhost, queue).await?.map(|q| Shape::of(&q));
        let raised = Instant::now();
        let fenced = match current.as_ref().and_then(|c| fence(queue, c)) {
            Some(policy) => {
                self.raise_fence(&policy).await?;
                true
            }
            None => false,
        };
        let swapped = self.swap_fenced(current.as_ref()).await;
        if fenced {
            let lifted = self.broker.management.delete_policy(self.vhost, &fence_name(queue)).await;
            // The next pass lifts it (Restoring does, first) if this one could not.
            match lifted {
                Ok(()) => self.state.fenced_millis = Some(raised.elapsed().as_millis() as i64),
                Err(e) => tracing::warn!(%queue, error = %e, "could not lift the swap's fence yet"),
            }
        }
        swapped
    }

    /// Puts the fence up, above every other policy of the vhost. The management API answers
    /// once the queue has been told (a message in its mailbox, or a command in its log, ahead of
    /// any publish sent after the answer); the statistics that would show it lag by seconds, so
    /// a short settle stands in for them, for a queue on another node.
    async fn raise_fence(&self, policy: &PolicyInfo) -> Result<(), Error> {
        let management = &self.broker.management;
        // The fence must outrank every policy there is now, so no older list will do.
        let others = management.policies(self.vhost, Duration::ZERO).await?;
        let top = others.iter().filter(|p| p.name != policy.name).map(|p| p.priority).max().unwrap_or(0);
        let policy = PolicyInfo { priority: policy.priority.max(top + 1), ..policy.clone() };
        management.put_policy(self.vhost, &policy).await?;
        tokio::time::sleep(FENCE_SETTLE).await;
        Ok(())
    }

    async fn swap_fenced(&mut self, current: Option<&Shape>) -> Result<(), Error> {
        let queue = self.target.queue.as_str();
        let arguments = field_table(&self.target.declare_arguments());
        let classic = current.is_none_or(|c| c.queue_type == "classic");
        for _ in 0..SWAP_ATTEMPTS {
            let ch = self.broker.amqp.channel().await?;
            let ready = ready_on(&ch, queue).await?;
            if !classic && ready > Some(0) {
                self.state.moved_out += self.drain(queue, self.holding).await?;
                continue;
            }
            // A refused passive declare closed its channel.
            let ch = if ready.is_some() { ch } else { self.broker.amqp.channel().await? };
            let started = Instant::now();
            let delete = async {
                if ready.is_none() {
                    return Ok(0);
                }
                // Quorum queues refuse if-empty (with a connection-level error): their emptiness
                // was read just before, and what the delete reports is counted.
                let options = QueueDeleteOptions { if_empty: classic, ..Default::default() };
                ch.queue_delete(queue.into(), options).await
            };
            let declare = ch.queue_declare(queue.into(), durable(), arguments.clone());
            let both = tokio::time::timeout(OPERATION_TIMEOUT, async { futures::join!(delete, declare) });
            let Ok((deleted, declared)) = both.await else {
                return Err(Error::Failed(format!("no answer from the broker while swapping queue '{queue}'")));
            };
            let window = started.elapsed();
            match (deleted, declared) {
                (Ok(dropped), Ok(_)) => {
                    self.state.swap_window_millis = Some(window.as_millis() as i64);
                    self.state.dropped_at_swap = Some(i64::from(dropped));
                    if dropped > 0 {
                        tracing::warn!(%queue, dropped, "messages raced the swap of a quorum queue and were deleted with it");
                    }
                    return Ok(());
                }
                (Err(e), _) | (_, Err(e)) => match self.broker.amqp.classify(e) {
                    // Not empty (messages arrived through the default exchange), or declared again
                    // with its old shape by an application in between: drain it and try again.
                    AmqpError::Refused(r) if r.code == PRECONDITION_FAILED => {
                        tracing::info!(%queue, reason = %r, "queue not empty at the swap; draining it again");
                        self.state.moved_out += self.drain(queue, self.holding).await?;
                    }
                    other => return Err(other.into()),
                },
            }
        }
        Err(Error::Failed(format!(
            "queue '{queue}' kept receiving messages through the default exchange: it was not empty at {SWAP_ATTEMPTS} attempts to swap it; the next pass tries again"
        )))
    }
}

/// Deletes a queue nothing routes to any more, once it is empty; a missing one is deleted.
async fn delete_emptied(broker: &Broker, queue: &str) -> Result<u32, Error> {
    let ch = broker.amqp.channel().await?;
    let Some(ready) = ready_on(&ch, queue).await? else { return Ok(0) };
    if ready > 0 {
        return Err(Error::Failed(format!(
            "holding queue '{queue}' still holds {ready} messages; moving them next pass"
        )));
    }
    let classic =
        broker.management.queue(broker.vhost(), queue).await?.is_none_or(|q| Shape::of(&q).queue_type == "classic");
    let options = QueueDeleteOptions { if_empty: classic, ..Default::default() };
    match ch.run(ch.queue_delete(queue.into(), options)).await {
        Ok(n) => Ok(n),
        Err(AmqpError::Refused(r)) if r.code == NOT_FOUND => Ok(0),
        Err(e) => Err(e.into()),
    }
}

/// The holding queue: durable, of the target type (replicated when the target is quorum), with
/// no limits, so nothing moved into it is dropped or dead-lettered. One left by a migration to
/// another shape (the spec changed midway) is kept as it is: it holds messages.
async fn ensure_holding(broker: &Broker, holding: &str, target: &Target) -> Result<(), Error> {
    let arguments = Map::from_iter([("x-queue-type".to_owned(), Value::from(target.queue_type.as_str()))]);
    let ch = broker.amqp.channel().await?;
    // Declared outright (a passive look first would cost a refused channel every time): the
    // broker refuses it only where a holding queue of another shape exists.
    match ch.run(ch.queue_declare(holding.into(), durable(), field_table(&arguments))).await {
        Ok(_) => Ok(()),
        Err(AmqpError::Refused(r)) if r.code == PRECONDITION_FAILED => Ok(()),
        Err(e) => Err(e.into()),
    }
}

fn describe(phase: MigrationPhase, queue: &str, holding: &str) -> String {
    match phase {
        MigrationPhase::Preparing => {
            format!("declaring holding queue '{holding}' and moving the exchange routes of '{queue}' to it")
        }
        MigrationPhase::Draining => format!("moving the messages of '{queue}' into '{holding}'"),
        MigrationPhase::Swapping => format!("deleting the emptied '{queue}' and declaring it with its new shape"),
        MigrationPhase::Restoring => format!("moving the exchange routes back from '{holding}' to '{queue}'"),
        MigrationPhase::Refilling => format!("moving the held messages back into '{queue}' and deleting '{holding}'"),
        other => other.as_str().to_owned(),
    }
}

fn durable() -> QueueDeclareOptions {
    QueueDeclareOptions { durable: true, ..Default::default() }
}

/// Ready messages in a queue, by passive declare on `ch`; None when there is no such queue (the
/// refusal closes `ch`).
async fn ready_on(ch: &PooledChannel<'_>, queue: &str) -> Result<Option<u32>, Error> {
    match ch.run(ch.queue_declare(queue.into(), passive(), FieldTable::default())).await {
        Ok(q) => Ok(Some(q.message_count())),
        Err(AmqpError::Refused(r)) if r.code == NOT_FOUND => Ok(None),
        Err(e) => Err(e.into()),
    }
}

fn passive() -> QueueDeclareOptions {
    QueueDeclareOptions { passive: true, ..Default::default() }
}

/// JSON arguments (as the management API lists them) as an AMQP table.
pub fn field_table(map: &Map<String, Value>) -> FieldTable {
    let mut table = FieldTable::default();
    for (k, v) in map {
        table.insert(k.as_str().into(), amqp_value(v));
    }
    table
}

fn amqp_value(v: &Value) -> AMQPValue {
    match v {
        Value::Null => AMQPValue::Void,
        Value::Bool(b) => AMQPValue::Boolean(*b),
        Value::Number(n) => match n.as_i64() {
            Some(i) => AMQPValue::LongLongInt(i),
            None => AMQPValue::Double(n.as_f64().unwrap_or_default()),
        },
        Value::String(s) => AMQPValue::LongString(s.as_str().into()),
        Value::Array(items) => {
            AMQPValue::FieldArray(FieldArray::from(items.iter().map(amqp_value).collect::<Vec<_>>()))
        }
        Value::Object(map) => AMQPValue::FieldTable(field_table(map)),
    }
}

/// Where a QueuePolicy's migration got in one pass.
#[derive(Debug)]
pub enum PolicyMigration {
    /// Both queues have their target shape.
    NotNeeded,
    /// A queue was moved (the last one's state, phase RestartingConsumers, not recorded yet).
    Moved(MigrationStatus),
    /// It cannot go on now: why, and the state to show (a refusal was recorded; a failure keeps
    /// the step it stopped at, for the next pass to resume).
    Stopped(Check, MigrationStatus),
}

/// Migrates a QueuePolicy's dead-letter queue, then its queue, where their shapes differ from
/// the plan's; `previous` is the last recorded state.
pub async fn migrate_policy<J: Journal + Send>(
    broker: &Broker,
    plan: &QueuePlan,
    previous: Option<&MigrationStatus>,
    journal: &mut J,
) -> Result<PolicyMigration, Error> {
    let mut tracked = Tracked { inner: journal, last: previous.cloned() };
    let mut moved = None;
    for target in [Target::of_dead_letter_queue(plan), Target::of_queue(plan)] {
        let resumed = tracked.last.clone();
        match migrate(broker, &target, resumed.as_ref(), &mut tracked).await {
            Ok(Ended::NotNeeded) => {}
            Ok(Ended::Moved(state)) => moved = Some(*state),
            Err(Error::Refused(why)) => {
                let state = MigrationStatus {
                    phase: MigrationPhase::Refused,
                    queue: target.queue.clone(),
                    to: target.shape().describe(),
                    message: why.clone(),
                    ..Default::default()
                };
                let told = resumed.as_ref().is_some_and(|r| r.phase == state.phase && r.message == state.message);
                if !told {
                    tracked.record(&state).await.map_err(|detail| Error::NotRecorded { phase: "Refused", detail })?;
                }
                return Ok(PolicyMigration::Stopped(Check::failed(Reason::MigrationRefused, why), state));
            }
            Err(e @ Error::NotRecorded { .. }) => return Err(e),
            Err(e) => {
                let mut state = tracked.last.clone().unwrap_or_default();
                state.message = format!("stopped at {}: {e}; the next pass resumes it", state.phase.as_str());
                return Ok(PolicyMigration::Stopped(Check::failed(Reason::MigrationFailed, e.to_string()), state));
            }
        }
    }
    Ok(moved.map_or(PolicyMigration::NotNeeded, PolicyMigration::Moved))
}

/// A moved queue's state once its consumers were restarted (`restarted` names what was), or
/// when nobody can restart them: they were cancelled by the swap, so status says so.
pub fn completed(mut state: MigrationStatus, restarted: Option<&str>) -> MigrationStatus {
    state.phase = MigrationPhase::Completed;
    state.finished_at = Some(Time(Timestamp::now()));
    state.consumers_restarted = Some(restarted.is_some());
    state.message = match restarted {
        Some(what) => format!("queue '{}' is now {}; restarted {what}", state.queue, state.to),
        None => format!(
            "queue '{}' is now {}; its consumers were cancelled by the swap and must be restarted (name them in spec.consumers for the operator to restart them through their rollout)",
            state.queue, state.to
        ),
    };
    state
}

/// A journal that remembers the last state recorded through it.
struct Tracked<'a, J> {
    inner: &'a mut J,
    last: Option<MigrationStatus>,
}

impl<J: Journal + Send> Journal for Tracked<'_, J> {
    async fn record(&mut self, state: &MigrationStatus) -> Result<(), String> {
        self.inner.record(state).await?;
        self.last = Some(state.clone());
        Ok(())
    }
}
