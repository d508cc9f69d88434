//! Carries out a migration on the broker, step by step, each recorded before it is taken.

use super::{
    Bounds, Error, Resume, Shape, Surroundings, Target, above, holding_name, holding_policy, holding_policy_name,
    is_fence_of,
    mover::{self, Moving},
    plain_declare_refused, refusal, resume_at, shared_conflict, swap, waiting_settings,
};
use crate::{
    broker::{
        Broker,
        amqp::{AmqpError, PooledChannel},
        management::{PolicyInfo, QueueInfo},
        refusal::{NOT_FOUND, PRECONDITION_FAILED},
    },
    claims::Claims,
    crd::{MigrationPhase, MigrationStatus, QueueType},
    plan::QueuePlan,
    settings,
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
    time::Duration,
};

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
    /// The queue has its new shape, its routes and its messages; its state, phase
    /// RestartingConsumers, is recorded (the caller restarts them, or says they must be).
    Moved(Box<MigrationStatus>),
}

/// A whole migration of `target.queue` on `broker` (in the broker's vhost), resumed where the
/// broker's state says it stopped. `previous` is the last recorded state (its counts and start
/// carry on). A step that cannot finish because of others (consumers holding deliveries, a
/// queue that delivers nothing to the mover, an exclusive consumer) unwinds before the queue is
/// deleted: routes and messages go back to the queue, which keeps its shape, and the error says
/// why.
pub async fn migrate<J: Journal>(
    broker: &Broker,
    target: &Target,
    previous: Option<&MigrationStatus>,
    journal: &mut J,
    bounds: &Bounds,
) -> Result<Ended, Error> {
    let vhost = broker.vhost().to_owned();
    let holding = holding_name(&target.queue);
    let info = broker.management.queue(&vhost, &target.queue).await?;
    let current = info.as_ref().map(Shape::of);
    let held = broker.management.queue(&vhost, &holding).await?.is_some();
    // A record of a migration to another shape (the spec changed midway) says nothing of this one.
    let in_progress = previous.filter(|p| {
        p.queue == target.queue && p.to == target.shape().describe() && p.phase <= MigrationPhase::RestartingConsumers
    });
    let mut state = in_progress.cloned().unwrap_or_default();
    let first = match resume_at(current.as_ref(), held, target, in_progress.map(|p| p.phase)) {
        Resume::NotNeeded => return Ok(Ended::NotNeeded),
        Resume::Start => {
            let (Some(info), Some(current)) = (&info, &current) else { unreachable!("Start means the queue exists") };
            if let Some(why) = refusal_on(broker, info, target).await? {
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

    let note = plain_declare_note(broker, target.queue_type).await;
    let mut step = Step { broker, target, holding: &holding, vhost: &vhost, state, journal, bounds, note };
    for phase in [
        MigrationPhase::Preparing,
        MigrationPhase::Draining,
        MigrationPhase::Swapping,
        MigrationPhase::Restoring,
        MigrationPhase::Refilling,
    ] {
        if phase < first {
            continue;
        }
        match step.take(phase).await {
            Ok(()) => {}
            // Before the swap deleted anything: the queue is there with its old shape.
            Err(e) if unwinds(&e) && phase <= MigrationPhase::Swapping => {
                step.unwind(&e).await?;
                return Err(e);
            }
            Err(e) => return Err(e),
        }
    }
    Ok(Ended::Moved(Box::new(step.state)))
}

/// Why a migration of the queue `info` describes to `target` cannot go ahead, from what the
/// broker says around it (feature flags, its consumers, the vhost's operator policies).
pub async fn refusal_on(broker: &Broker, info: &QueueInfo, target: &Target) -> Result<Option<String>, Error> {
    let flags = match target.queue_type {
        QueueType::Quorum => broker.management.feature_flags().await?,
        QueueType::Classic => None,
    };
    let operator_policies = broker.management.operator_policies(broker.vhost()).await?;
    let around = Surroundings {
        flags: flags.as_deref(),
        consumers: &info.consumer_details,
        operator_policies: &operator_policies,
    };
    Ok(refusal(&Shape::of(info), target, &around))
}

/// Why the applications' plain declares of the queue will be refused once it has `to`'s type
/// ([`plain_declare_refused`]), from the broker's version and the vhost's default queue type;
/// None where they will be taken, or the broker does not say.
pub async fn plain_declare_note(broker: &Broker, to: QueueType) -> Option<String> {
    let version = broker.management.version().await.ok()?;
    let default = broker.management.default_queue_type(broker.vhost()).await.ok()?;
    plain_declare_refused(to, version.as_deref(), default.as_deref())
}

/// The target recorded on the holding queue of `queue` (see [`ensure_holding`]): where a
/// migration was going when it was cut off between deleting the queue and declaring it again.
pub async fn recorded_target(broker: &Broker, queue: &str) -> Result<Option<Target>, Error> {
    let holding = broker.management.queue(broker.vhost(), &holding_name(queue)).await?;
    let recorded = holding.as_ref().and_then(|h| h.arguments.get(TARGET_ARGUMENT)).and_then(Value::as_str);
    let Some(mut arguments) = recorded.and_then(|r| serde_json::from_str::<Map<String, Value>>(r).ok()) else {
        return Ok(None);
    };
    let queue_type = match arguments.remove("x-queue-type").as_ref().and_then(Value::as_str) {
        Some("quorum") => QueueType::Quorum,
        _ => QueueType::Classic,
    };
    Ok(Some(Target { queue: queue.to_owned(), queue_type, arguments }))
}

/// Errors that others caused, which time will not mend within this attempt.
fn unwinds(e: &Error) -> bool {
    matches!(e, Error::Unacknowledged { .. } | Error::Publishing { .. } | Error::Stalled { .. } | Error::Refused(_))
}

struct Step<'a, J> {
    broker: &'a Broker,
    target: &'a Target,
    holding: &'a str,
    vhost: &'a str,
    state: MigrationStatus,
    journal: &'a mut J,
    bounds: &'a Bounds,
    /// Why the applications' plain declares will be refused afterwards, if they will be.
    note: Option<String>,
}

impl<J: Journal> Step<'_, J> {
    async fn record(&mut self, phase: MigrationPhase, message: String) -> Result<(), Error> {
        self.state.phase = phase;
        self.state.message = message;
        self.journal.record(&self.state).await.map_err(|detail| Error::NotRecorded { phase: phase.as_str(), detail })
    }

    async fn take(&mut self, phase: MigrationPhase) -> Result<(), Error> {
        let mut message = describe(phase, &self.target.queue, self.holding);
        if let (MigrationPhase::Preparing, Some(note)) = (phase, &self.note) {
            message = format!("{message}; note: {note}");
        }
        self.record(phase, message).await?;
        let (queue, holding) = (self.target.queue.as_str(), self.holding);
        match phase {
            MigrationPhase::Preparing => {
                self.hold().await?;
                self.reroute(queue, holding).await
            }
            MigrationPhase::Draining => {
                self.state.moved_out += self.drain(queue, holding).await?;
                Ok(())
            }
            MigrationPhase::Swapping => {
                let swapped = swap::swap(self.broker, self.target, holding, self.bounds).await;
                let swapped = match swapped {
                    Ok(s) => s,
                    Err((e, moved)) => {
                        self.state.moved_out += moved as i64;
                        return Err(e);
                    }
                };
                self.state.moved_out += swapped.moved_out as i64;
                self.state.swap_window_millis = swapped.window.map(|w| w.as_millis() as i64);
                self.state.fenced_millis = swapped.fenced.map(|f| f.as_millis() as i64);
                self.state.dropped_at_swap = Some(i64::from(swapped.dropped));
                Ok(())
            }
            MigrationPhase::Restoring => {
                // A swap cut off before it lifted its fence left it up.
                lift_fences(self.broker, queue).await?;
                self.reroute(holding, queue).await
            }
            MigrationPhase::Refilling => {
                self.state.moved_back += self.drain(holding, queue).await?;
                // Recorded before the holding queue goes: once it has gone, only the record
                // says that the consumers the swap cancelled are still to be restarted.
                let mut done = format!("queue '{queue}' is now {}; its consumers are to be restarted", self.state.to);
                if let Some(note) = &self.note {
                    done = format!("{done}; note: {note}");
                }
                self.record(MigrationPhase::RestartingConsumers, done).await?;
                delete_holding(self.broker, queue).await
            }
            _ => Ok(()),
        }
    }

    /// Puts the holding queue's policy up, then declares it: the policy applies from the
    /// queue's first moment.
    async fn hold(&self) -> Result<(), Error> {
        let management = &self.broker.management;
        let policies = management.policies(self.vhost, Duration::ZERO).await?;
        let queue = &self.target.queue;
        let current = management
            .queue(self.vhost, queue)
            .await?
            .map(|q| Shape::of(&q))
            .ok_or_else(|| Error::Failed(format!("queue '{queue}' is gone; the next pass looks again")))?;
        let waiting = waiting_settings(&current, applying(queue, &current.queue_type, &policies));
        management.put_policy(self.vhost, &holding_policy(queue, &waiting, above(&policies))).await?;
        ensure_holding(self.broker, self.holding, self.target).await
    }

    /// Moves routes and messages back to the queue, which keeps its shape, and says why.
    async fn unwind(&mut self, why: &Error) -> Result<(), Error> {
        let (queue, holding) = (self.target.queue.as_str(), self.holding);
        let message =
            format!("moving the exchange routes and the messages back to '{queue}', which keeps its shape: {why}");
        self.record(MigrationPhase::Restoring, message).await?;
        lift_fences(self.broker, queue).await?;
        self.reroute(holding, queue).await?;
        self.state.moved_back += self.drain(holding, queue).await?;
        delete_holding(self.broker, queue).await?;
        self.state.finished_at = Some(Time(Timestamp::now()));
        self.record(MigrationPhase::RolledBack, why.to_string()).await
    }

    async fn drain(&self, from: &str, to: &str) -> Result<i64, Error> {
        drain(self.broker, from, to, self.bounds).await
    }

    async fn reroute(&self, from: &str, to: &str) -> Result<(), Error> {
        reroute(self.broker, from, to).await
    }
}

async fn drain(broker: &Broker, from: &str, to: &str, bounds: &Bounds) -> Result<i64, Error> {
    let moved = AtomicU64::new(0);
    let how = Moving { first: false, stall: bounds.stall };
    let result = mover::drain(broker, from, to, how, &moved).await;
    if result.is_err() {
        tracing::info!(%from, %to, moved = moved.load(Ordering::Relaxed), "move cut short; resumes next pass");
    }
    result.map(|n| n as i64)
}

/// Binds `to` wherever either queue is bound from an exchange, then unbinds `from`: a message
/// routed meanwhile reaches one of them, or both (a duplicate, never a loss). The unbinding
/// names each binding by the broker's own key: its arguments, read back as JSON, have lost their
/// AMQP types (a short integer comes back as a long one) and would match nothing.
async fn reroute(broker: &Broker, from: &str, to: &str) -> Result<(), Error> {
    let (management, vhost) = (&broker.management, broker.vhost());
    let mut routes = management.queue_bindings(vhost, from).await?;
    routes.extend(management.queue_bindings(vhost, to).await?);
    routes.retain(|b| !b.source.is_empty());
    let ch = broker.amqp.channel().await?;
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
    for b in routes.iter().filter(|b| b.destination == from) {
        management.delete_queue_binding(vhost, &b.source, from, &b.properties_key).await?;
    }
    Ok(())
}

/// Brings a migration of `queue` left midway (its QueuePolicy deleted, or no longer saying
/// Migrate) to rest, losing nothing: its fences lifted, a queue the swap deleted declared again
/// (with the target recorded on its holding queue, else `fallback`), and routes and messages
/// moved back from the holding queue into the queue, whatever shape it has now. Returns whether
/// there was anything to settle.
pub async fn settle_abandoned(
    broker: &Broker,
    queue: &str,
    fallback: Option<&Target>,
    bounds: &Bounds,
) -> Result<bool, Error> {
    let vhost = broker.vhost();
    let holding = holding_name(queue);
    let held = broker.management.queue(vhost, &holding).await?.is_some();
    let policies = broker.management.policies(vhost, Duration::ZERO).await?;
    if !held && !policies.iter().any(|p| is_fence_of(p, queue)) {
        return Ok(false);
    }
    lift_fences(broker, queue).await?;
    if held {
        if broker.management.queue(vhost, queue).await?.is_none() {
            let target = match recorded_target(broker, queue).await? {
                Some(target) => target,
                None => fallback.cloned().ok_or_else(|| {
                    Error::Failed(format!(
                        "queue '{queue}' is missing and its holding queue records no shape to declare it with"
                    ))
                })?,
            };
            swap::declare(broker, &target).await?;
        }
        reroute(broker, &holding, queue).await?;
        drain(broker, &holding, queue, bounds).await?;
        delete_holding(broker, queue).await?;
    }
    Ok(true)
}

/// The policy that applies to a queue now, the migration's own aside.
pub(super) fn applying<'a>(queue: &str, queue_type: &str, policies: &'a [PolicyInfo]) -> Option<&'a PolicyInfo> {
    let (matching, _) = settings::matching_policies(queue, queue_type, policies);
    matching.into_iter().find(|p| !super::is_own(p))
}

/// Takes down every fence of `queue`, this attempt's or an earlier one's.
pub(super) async fn lift_fences(broker: &Broker, queue: &str) -> Result<(), Error> {
    let vhost = broker.vhost();
    let policies = broker.management.policies(vhost, Duration::ZERO).await?;
    for fence in policies.iter().filter(|p| is_fence_of(p, queue)) {
        broker.management.delete_policy(vhost, &fence.name).await?;
    }
    Ok(())
}

/// Deletes the holding queue of `queue` once empty (routes no longer lead there), then its
/// policy.
async fn delete_holding(broker: &Broker, queue: &str) -> Result<(), Error> {
    delete_emptied(broker, &holding_name(queue)).await?;
    broker.management.delete_policy(broker.vhost(), &holding_policy_name(queue)).await?;
    Ok(())
}

/// Deletes a queue nothing routes to any more, once empty; a missing one is deleted.
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

/// The argument of the holding queue that records the target's declare arguments (as JSON):
/// the one record of the shape to declare when a swap was cut off after the deletion and
/// nothing else remembers it (`queueguard migrate` keeps no journal). Brokers keep unknown
/// arguments.
const TARGET_ARGUMENT: &str = "x-queueguard-target";

/// The holding queue: durable, of the target type (replicated when the target is quorum), with
/// the target recorded. Its policy, put up before, decides everything else. One left by a
/// migration to another shape (the spec changed midway) is kept as it is: it holds messages.
async fn ensure_holding(broker: &Broker, holding: &str, target: &Target) -> Result<(), Error> {
    let recorded = Value::from(Value::Object(target.declare_arguments()).to_string());
    let arguments = Map::from_iter([
        ("x-queue-type".to_owned(), Value::from(target.queue_type.as_str())),
        (TARGET_ARGUMENT.to_owned(), recorded),
    ]);
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
        MigrationPhase::Swapping => format!(
            "waiting until the consumers of '{queue}' hold no unacknowledged delivery, then deleting the emptied queue and declaring it with its new shape"
        ),
        MigrationPhase::Restoring => format!("moving the exchange routes back from '{holding}' to '{queue}'"),
        MigrationPhase::Refilling => format!("moving the held messages back into '{queue}' and deleting '{holding}'"),
        other => other.as_str().to_owned(),
    }
}

pub(super) fn durable() -> QueueDeclareOptions {
    QueueDeclareOptions { durable: true, ..Default::default() }
}

/// Ready messages in a queue, by passive declare on `ch`; None when there is no such queue (the
/// refusal closes `ch`).
pub(super) async fn ready_on(ch: &PooledChannel<'_>, queue: &str) -> Result<Option<u32>, Error> {
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
    /// A queue was moved (the last one's state, phase RestartingConsumers, recorded).
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
    bounds: &Bounds,
    claims: &Claims,
) -> Result<PolicyMigration, Error> {
    let mut tracked = Tracked { inner: journal, last: previous.cloned() };
    let mut moved = None;
    for target in [Target::of_dead_letter_queue(plan), Target::of_queue(plan)] {
        let resumed = tracked.last.clone();
        let migrated = match shared_conflict(&target, claims) {
            Some(why) if needs_moving(broker, &target).await? => Err(Error::Refused(why)),
            _ => migrate(broker, &target, resumed.as_ref(), &mut tracked, bounds).await,
        };
        match migrated {
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
            // Unwound: the record says so, and why.
            Err(e @ (Error::Unacknowledged { .. } | Error::Publishing { .. } | Error::Stalled { .. })) => {
                let state = tracked.last.clone().unwrap_or_default();
                return Ok(PolicyMigration::Stopped(Check::failed(Reason::MigrationRolledBack, e.to_string()), state));
            }
            Err(e) => {
                let mut state = tracked.last.clone().unwrap_or_default();
                state.message = format!("stopped at {}: {e}; the next pass resumes it", state.phase.as_str());
                return Ok(PolicyMigration::Stopped(Check::failed(Reason::MigrationFailed, e.to_string()), state));
            }
        }
    }
    Ok(moved.map_or(PolicyMigration::NotNeeded, PolicyMigration::Moved))
}

/// Whether the queue exists with another shape than `target`'s.
async fn needs_moving(broker: &Broker, target: &Target) -> Result<bool, Error> {
    let queue = broker.management.queue(broker.vhost(), &target.queue).await?;
    Ok(queue.is_some_and(|q| !super::differences(&Shape::of(&q), target).is_empty()))
}

/// Settles whatever migration of `queues` (a QueuePolicy's dead-letter queue and queue, with the
/// shapes its plan gives them) was left midway ([`settle_abandoned`]).
pub async fn settle_policy(broker: &Broker, queues: &[Target], bounds: &Bounds) -> Result<bool, Error> {
    let mut settled = false;
    for target in queues {
        settled |= settle_abandoned(broker, &target.queue, Some(target), bounds).await?;
    }
    Ok(settled)
}

/// Settles a recorded migration `m` of a QueuePolicy's queues that stopped midway because `why`
/// (onChange no longer says Migrate): its state after, RestartingConsumers where the swap had
/// already given the queue its new shape (the consumers it cancelled are to be restarted), else
/// RolledBack.
pub async fn settle_recorded(
    broker: &Broker,
    plan: &QueuePlan,
    m: &MigrationStatus,
    why: &str,
) -> Result<MigrationStatus, Error> {
    let queues = [Target::of_dead_letter_queue(plan), Target::of_queue(plan)];
    settle_policy(broker, &queues, &Bounds::default()).await?;
    let now = broker.management.queue(broker.vhost(), &m.queue).await?.map(|q| Shape::of(&q).describe());
    let mut state = m.clone();
    if now.as_deref() == Some(m.to.as_str()) {
        state.phase = MigrationPhase::RestartingConsumers;
        state.message =
            format!("{why}, but queue '{}' had been swapped: it is {} with its routes and messages", m.queue, m.to);
    } else {
        state.phase = MigrationPhase::RolledBack;
        state.finished_at = Some(Time(Timestamp::now()));
        state.message = format!(
            "{why}: the migration of '{}' to {} stopped at {}, and its routes and messages are back on it; it keeps its shape",
            m.queue,
            m.to,
            m.phase.as_str()
        );
    }
    Ok(state)
}

/// How long a migration that unwound waits before the operator tries it again.
pub const RETRY_AFTER_UNWINDING: Duration = Duration::from_secs(300);

/// When a migration that unwound (`m`, recorded RolledBack) may be tried again, if that is still
/// to come at `now`.
pub fn next_attempt(m: &MigrationStatus, now: Timestamp) -> Option<Timestamp> {
    let ended = m.finished_at.as_ref().filter(|_| m.phase == MigrationPhase::RolledBack)?.0;
    let at = ended.checked_add(RETRY_AFTER_UNWINDING).ok()?;
    (now < at).then_some(at)
}

/// Whether a recorded migration stopped between its first step and the end of its moves.
pub fn midway(m: &MigrationStatus) -> bool {
    m.phase < MigrationPhase::RestartingConsumers
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
