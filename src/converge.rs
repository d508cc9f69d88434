//! The broker side of a reconcile: declare the dead-letter exchange and queue, the queue, its
//! settings (policy or arguments) and bindings, and report each step as a [`Check`].
//!
//! It never deletes, purges or re-creates a queue while converging. A refused declare closes
//! only its channel; later steps take a fresh one, so one policy's conflict cannot disturb others.

use crate::{
    broker::{
        Broker,
        amqp::AmqpError,
        listing::Want,
        management::{LISTING_MAX_AGE, ManagementError, QueueInfo},
        refusal::{ACCESS_REFUSED, Inequivalence, NOT_FOUND, PRECONDITION_FAILED, Refusal},
    },
    claims::Claims,
    crd::{Binding, DeadLetterObservation, QueueObservation, QueueType, SettingsMode},
    duration::Human,
    plan::QueuePlan,
    settings::{self, ArgValue, PolicyDecision},
    status::{Check, Outcome, Reason},
};
use lapin::{
    ExchangeKind,
    options::{
        ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions,
    },
    types::{AMQPValue, FieldTable},
};
use std::collections::{BTreeMap, BTreeSet};

/// How the queue itself is checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Declare it (creating it if missing). Every declare renews its x-expires lease.
    Declare,
    /// Look at it through the management API only, so an unused queue still expires on schedule
    /// (keepAlive: false, once the queue has been declared for this generation).
    Inspect,
}

/// Why a step could not finish.
enum StepError {
    Unreachable(String),
    /// The connection went away mid-step (closed by the broker, perhaps for another policy's
    /// operation): worth one more try on a fresh connection.
    Lost(String),
    Refused(Refused),
}

/// What refused a step, as a condition reports it.
enum Refused {
    /// The broker refused an AMQP operation.
    Broker(Refusal),
    /// The entity exists with other settings, on this argument; with the broker's refusal when
    /// a declare was refused (an inspection through the management API has none).
    Conflict(Inequivalence, Option<Refusal>),
    /// The queue is not there (seen through the management API).
    QueueMissing,
    /// The management API refused the request.
    Management(ManagementError),
}

impl From<AmqpError> for StepError {
    fn from(e: AmqpError) -> Self {
        match e {
            AmqpError::Refused(r) => Self::Refused(match r.inequivalence() {
                Some(i) => Refused::Conflict(i, Some(r)),
                None => Refused::Broker(r),
            }),
            lost @ AmqpError::Lost { .. } => Self::Lost(lost.to_string()),
            unreachable => Self::Unreachable(unreachable.to_string()),
        }
    }
}

/// Converges one plan on one broker. `previous_bindings` are those applied last time, so ones
/// removed from the spec are unbound. Every step is idempotent, so a connection lost midway
/// (another policy's operation can make the broker close the shared connection) is answered by
/// going through them once more on a fresh connection, at once rather than at the next requeue.
pub async fn converge(plan: &QueuePlan, broker: &Broker, previous_bindings: &[Binding], mode: Mode) -> Outcome {
    match converge_once(plan, broker, previous_bindings, mode).await {
        Ok(outcome) => outcome,
        Err(lost) => {
            tracing::info!(queue = %plan.queue, %lost, "connection lost while converging; once more");
            converge_once(plan, broker, previous_bindings, mode).await.unwrap_or_else(unreachable)
        }
    }
}

/// One pass through the steps; Err when the connection was lost midway.
async fn converge_once(
    plan: &QueuePlan,
    broker: &Broker,
    previous_bindings: &[Binding],
    mode: Mode,
) -> Result<Outcome, String> {
    let vhost = broker.vhost().to_owned();
    let (dead_letter, dead_letter_observation) = match declare_dead_letter(plan, broker).await {
        Ok(obs) => (Check::ok(Reason::Declared, dead_letter_summary(plan)), Some(obs)),
        Err(StepError::Unreachable(msg)) => return Ok(unreachable(msg)),
        Err(StepError::Lost(msg)) => return Err(msg),
        Err(StepError::Refused(r)) => {
            (refused_check(&r, &format!("dead-letter exchange or queue of {}", plan.queue)), None)
        }
    };

    let queue_step = match mode {
        Mode::Declare => declare_queue(plan, broker).await,
        Mode::Inspect => inspect_queue(plan, broker, &vhost).await,
    };
    let (mut queue, mut queue_observation) = match queue_step {
        Ok(obs) => (Check::ok(Reason::Declared, queue_summary(plan, &vhost)), Some(obs)),
        Err(StepError::Unreachable(msg)) => return Ok(unreachable(msg)),
        Err(StepError::Lost(msg)) => return Err(msg),
        Err(StepError::Refused(r)) => (queue_refusal(plan, &vhost, &r), None),
    };

    let (settings, broker_policy) = if !queue.is_ok() {
        (Check::unknown(Reason::QueueNotDeclared, "settings wait until the queue is declared as specified"), None)
    } else {
        match plan.mode {
            SettingsMode::Arguments => {
                (Check::ok(Reason::ArgumentsApplied, format!("{} set as queue arguments", settings_list(plan))), None)
            }
            SettingsMode::Policy => apply_policy(plan, broker, &vhost).await,
        }
    };

    let mut applied_bindings = None;
    if queue.is_ok() && (mode == Mode::Declare || previous_bindings != plan.bindings) {
        let (applied, failure) = apply_bindings(plan, broker, previous_bindings).await;
        applied_bindings = Some(applied);
        match failure {
            None => {}
            Some(StepError::Lost(msg)) => return Err(msg),
            Some(StepError::Unreachable(msg)) => queue = Check::unknown(Reason::BrokerUnreachable, msg),
            Some(StepError::Refused(r)) => queue = binding_refusal(plan, &vhost, &r),
        }
    }

    if let Some(obs) = queue_observation.as_mut().filter(|o| o.messages_unacknowledged.is_none()) {
        // Unacknowledged counts only exist in the management API; absent for a brand-new queue.
        // From the vhost's shared listing: a renewal of a thousand policies costs no read each.
        // One older than the queue is read again, else the count would wait for the next renewal
        // and cost a status patch then.
        let want = Want::Queues(&[plan.queue.as_str()]);
        let listing = broker.management.queues_holding(&vhost, &plan.queue, want, LISTING_MAX_AGE).await.ok();
        if let Some(info) = listing.as_ref().and_then(|l| l.queues.get(&plan.queue)) {
            obs.messages_unacknowledged = info.messages_unacknowledged;
        }
    }

    Ok(Outcome {
        queue,
        dead_letter,
        settings,
        queue_observation,
        dead_letter_observation,
        broker_policy,
        applied_bindings,
        gate: None,
        findings: None,
        migration: None,
    })
}

/// A queue another tool declares (spec.adopt): only looked at, through the management API, and
/// nothing declared, bound or set. `owner` names that tool's object when the operator knows it.
pub async fn adopted(plan: &QueuePlan, broker: &Broker, owner: Option<&str>) -> Outcome {
    let vhost = broker.vhost();
    let who =
        owner.map_or_else(|| "its owner".to_owned(), |o| format!("Queue '{o}' of the Messaging Topology Operator"));
    let info = match broker.management.queue(vhost, &plan.queue).await {
        Ok(info) => info,
        Err(e @ ManagementError::Unreachable { .. }) => return unreachable(e.to_string()),
        Err(e) => return Outcome::blocked(policy_failure(e)),
    };
    let Some(info) = info else {
        return Outcome::blocked(Check::failed(
            Reason::QueueNotFound,
            format!("queue '{}' in vhost '{vhost}' does not exist; with adopt: true, {who} declares it", plan.queue),
        ));
    };
    let theirs =
        |what: &str| Check::ok(Reason::Adopted, format!("{what} of queue '{}' are {who}'s (adopt: true)", plan.queue));
    let mut outcome = Outcome::blocked(theirs("the settings"));
    outcome.queue = Check::ok(
        Reason::Adopted,
        format!(
            "queue '{}' in vhost '{vhost}' is declared by {who} (adopt: true): queueguard reports on it and guards its consumers, and declares nothing",
            plan.queue
        ),
    );
    outcome.dead_letter = theirs("the dead-letter exchange and queue");
    outcome.queue_observation = Some(observed(plan, vhost, &info));
    outcome
}

/// What the management API says of the plan's queue.
fn observed(plan: &QueuePlan, vhost: &str, info: &QueueInfo) -> QueueObservation {
    QueueObservation {
        name: plan.queue.clone(),
        vhost: vhost.to_owned(),
        messages_ready: info.messages_ready,
        messages_unacknowledged: info.messages_unacknowledged,
        consumers: info.consumers,
    }
}

fn unreachable(message: String) -> Outcome {
    Outcome::blocked(Check::unknown(Reason::BrokerUnreachable, message))
}

async fn declare_dead_letter(plan: &QueuePlan, broker: &Broker) -> Result<DeadLetterObservation, StepError> {
    let s = &plan.settings;
    let amqp = &broker.amqp;
    let ch = amqp.channel().await?;
    let durable = ExchangeDeclareOptions { durable: true, ..Default::default() };
    ch.run(ch.exchange_declare(
        s.dead_letter_exchange.as_str().into(),
        ExchangeKind::Direct,
        durable,
        FieldTable::default(),
    ))
    .await?;
    let dlq = ch
        .run(ch.queue_declare(
            plan.dead_letter_queue.as_str().into(),
            durable_queue(),
            field_table(&settings::dead_letter_queue_arguments(plan)),
        ))
        .await?;
    ch.run(ch.queue_bind(
        plan.dead_letter_queue.as_str().into(),
        s.dead_letter_exchange.as_str().into(),
        s.dead_letter_routing_key.as_str().into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    ))
    .await?;
    Ok(DeadLetterObservation {
        exchange: s.dead_letter_exchange.clone(),
        queue: plan.dead_letter_queue.clone(),
        messages_ready: Some(i64::from(dlq.message_count())),
    })
}

async fn declare_queue(plan: &QueuePlan, broker: &Broker) -> Result<QueueObservation, StepError> {
    let ch = broker.amqp.channel().await?;
    let q = ch
        .run(ch.queue_declare(
            plan.queue.as_str().into(),
            durable_queue(),
            field_table(&settings::queue_arguments(plan)),
        ))
        .await?;
    Ok(QueueObservation {
        name: plan.queue.clone(),
        vhost: broker.vhost().to_owned(),
        messages_ready: Some(i64::from(q.message_count())),
        messages_unacknowledged: None,
        consumers: Some(i64::from(q.consumer_count())),
    })
}

/// Checks the queue through the management API, which does not renew its expiry lease.
async fn inspect_queue(plan: &QueuePlan, broker: &Broker, vhost: &str) -> Result<QueueObservation, StepError> {
    let info = broker.management.queue(vhost, &plan.queue).await.map_err(management_step_error)?;
    let Some(info) = info else { return Err(StepError::Refused(Refused::QueueMissing)) };
    let mut diffs = settings::argument_differences(&settings::queue_arguments(plan), &info.arguments);
    if !info.durable || info.auto_delete || info.exclusive {
        diffs.insert(
            0,
            crate::broker::refusal::Inequivalence {
                argument: "durable/auto_delete/exclusive".into(),
                received: Some("true/false/false".into()),
                current: Some(format!("{}/{}/{}", info.durable, info.auto_delete, info.exclusive)),
            },
        );
    }
    if let Some(first) = diffs.into_iter().next() {
        return Err(StepError::Refused(Refused::Conflict(first, None)));
    }
    Ok(observed(plan, vhost, &info))
}

fn management_step_error(e: ManagementError) -> StepError {
    match e {
        ManagementError::Unreachable { .. } => StepError::Unreachable(e.to_string()),
        refused => StepError::Refused(Refused::Management(refused)),
    }
}

/// A broker policy the management API would not read or write.
pub fn policy_failure(e: ManagementError) -> Check {
    match e {
        ManagementError::Unreachable { .. } => Check::unknown(Reason::BrokerUnreachable, e.to_string()),
        ManagementError::Rejected { status: 401 | 403, .. } => Check::failed(Reason::AccessRefused, e.to_string()),
        ManagementError::InvalidCa(_) | ManagementError::Unaddressable(_) => {
            Check::failed(Reason::InvalidBrokerUri, e.to_string())
        }
        ManagementError::Rejected { .. }
        | ManagementError::UnexpectedBody { .. }
        | ManagementError::TooLarge { .. } => Check::failed(Reason::PolicyRejected, e.to_string()),
    }
}

async fn apply_policy(plan: &QueuePlan, broker: &Broker, vhost: &str) -> (Check, Option<String>) {
    let failed = policy_failure;
    let decision = match broker
        .management
        .decide_on_policies(vhost, |existing| settings::policy_decision(plan, existing), PolicyDecision::settled)
        .await
    {
        Ok(d) => d,
        Err(e) => return (failed(e), None),
    };
    if !decision.up_to_date
        && let Err(e) = broker.management.put_policy(vhost, &decision.desired).await
    {
        return (failed(e), None);
    }
    let name = Some(decision.desired.name.clone());
    if let Some(winner) = decision.shadowed_by {
        let msg = format!(
            "policy '{}' (pattern {:?}, priority {}) also matches queue '{}' at priority {} or higher; RabbitMQ applies one policy per queue, so {} from '{}' are not in effect. Lower that policy's priority below {} or narrow its pattern; queueguard leaves it alone",
            winner.name,
            winner.pattern,
            winner.priority,
            plan.queue,
            settings::POLICY_PRIORITY,
            settings_list(plan),
            decision.desired.name,
            settings::POLICY_PRIORITY
        );
        let mut msg = msg;
        if plan.queue_type == QueueType::Quorum && !winner.definition.contains_key("dead-letter-exchange") {
            msg.push_str(&format!(
                ". Quorum queue '{}' is left without a dead-letter exchange: on RabbitMQ 4.0 and later its delivery limit (20 unless that policy sets delivery-limit) drops a message redelivered that often instead of dead-lettering it",
                plan.queue
            ));
        }
        return (Check::failed(Reason::PolicyShadowed, msg), name);
    }
    let mut msg = format!("policy '{}' applies {}", decision.desired.name, settings_list(plan));
    if let Some(displaced) = &decision.displaced {
        msg.push_str(&format!(" and carries forward the other keys of policy '{displaced}', which it displaces"));
    }
    if !decision.unreadable.is_empty() {
        msg.push_str(&format!("; could not evaluate the pattern of {:?}, check them by hand", decision.unreadable));
    }
    (Check::ok(Reason::PolicyApplied, msg), name)
}

/// Binds what the spec lists and unbinds what it no longer lists. Returns the bindings now in
/// place, even when a step failed, so a later reconcile knows what to unbind.
async fn apply_bindings(plan: &QueuePlan, broker: &Broker, previous: &[Binding]) -> (Vec<Binding>, Option<StepError>) {
    let mut applied: Vec<Binding> = previous.to_vec();
    let amqp = &broker.amqp;
    let ch = match amqp.channel().await {
        Ok(ch) => ch,
        Err(e) => return (applied, Some(e.into())),
    };
    for b in &plan.bindings {
        let bound = ch
            .run(ch.queue_bind(
                plan.queue.as_str().into(),
                b.exchange.as_str().into(),
                b.routing_key.as_str().into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            ))
            .await;
        match bound {
            Ok(()) if !applied.contains(b) => applied.push(b.clone()),
            Ok(()) => {}
            Err(e) => return (applied, Some(e.into())),
        }
    }
    drop(ch);
    for b in previous.iter().filter(|b| !plan.bindings.contains(b)) {
        let ch = match broker.amqp.channel().await {
            Ok(ch) => ch,
            Err(e) => return (applied, Some(e.into())),
        };
        let unbound = ch
            .run(ch.queue_unbind(
                plan.queue.as_str().into(),
                b.exchange.as_str().into(),
                b.routing_key.as_str().into(),
                FieldTable::default(),
            ))
            .await;
        match unbound.map_err(StepError::from) {
            // The exchange is gone, and the binding with it.
            Ok(()) | Err(StepError::Refused(Refused::Broker(Refusal { code: NOT_FOUND, .. }))) => {
                applied.retain(|a| a != b)
            }
            Err(other) => return (applied, Some(other)),
        }
    }
    applied.sort();
    (applied, None)
}

fn durable_queue() -> QueueDeclareOptions {
    QueueDeclareOptions { durable: true, ..Default::default() }
}

fn field_table(args: &BTreeMap<&'static str, ArgValue>) -> FieldTable {
    let mut table = FieldTable::default();
    for (k, v) in args {
        let value = match v {
            ArgValue::Long(n) => AMQPValue::LongLongInt(*n),
            ArgValue::Str(s) => AMQPValue::LongString(s.as_str().into()),
        };
        table.insert((*k).into(), value);
    }
    table
}

fn queue_summary(plan: &QueuePlan, vhost: &str) -> String {
    format!(
        "queue '{}' in vhost '{vhost}' is durable ({}), expires after {} unused",
        plan.queue,
        plan.queue_type.as_str(),
        Human(plan.settings.expires)
    )
}

fn dead_letter_summary(plan: &QueuePlan) -> String {
    let s = &plan.settings;
    format!(
        "dead letters go to exchange '{}' and queue '{}' (routing key '{}')",
        s.dead_letter_exchange, plan.dead_letter_queue, s.dead_letter_routing_key
    )
}

fn settings_list(plan: &QueuePlan) -> String {
    let s = &plan.settings;
    let mut parts = vec![format!("expires {}", Human(s.expires)), "dead-lettering".to_owned()];
    if let Some(ttl) = s.message_ttl {
        parts.push(format!("message TTL {}", Human(ttl)));
    }
    if let Some(n) = s.max_length {
        parts.push(format!("max length {n}{}", s.overflow.map(|o| format!(" ({})", o.as_str())).unwrap_or_default()));
    }
    if plan.queue_type == QueueType::Quorum {
        parts.push(match s.delivery_limit {
            Some(-1) => "no delivery limit (a message requeued over and over stays for ever)".to_owned(),
            Some(n) => format!("delivery limit {n}"),
            None => "the broker's delivery limit (20 on RabbitMQ 4.0 and later)".to_owned(),
        });
    }
    parts.join(", ")
}

fn refused_check(r: &Refused, what: &str) -> Check {
    let never = "queueguard never deletes or re-creates an existing entity";
    match r {
        Refused::Conflict(i, Some(r)) => {
            Check::failed(Reason::ArgumentsConflict, format!("{what}: {i}; {never} ({r})"))
        }
        Refused::Conflict(i, None) => Check::failed(Reason::ArgumentsConflict, format!("{what}: {i}; {never}")),
        Refused::Broker(r) if r.code == ACCESS_REFUSED => {
            Check::failed(Reason::AccessRefused, format!("{what}: the broker user lacks permission ({r})"))
        }
        Refused::Broker(r) => Check::failed(Reason::BrokerRefused, format!("{what}: {r}")),
        Refused::QueueMissing => Check::failed(Reason::QueueNotFound, format!("{what}: the queue is not there")),
        Refused::Management(e @ ManagementError::Rejected { status: 401 | 403, .. }) => {
            Check::failed(Reason::AccessRefused, format!("{what}: the broker user lacks permission ({e})"))
        }
        Refused::Management(e) => Check::failed(Reason::BrokerRefused, format!("{what}: {e}")),
    }
}

fn queue_refusal(plan: &QueuePlan, vhost: &str, r: &Refused) -> Check {
    if matches!(r, Refused::QueueMissing | Refused::Broker(Refusal { code: NOT_FOUND, .. })) {
        return Check::failed(
            Reason::QueueNotFound,
            format!(
                "queue '{}' is gone from vhost '{vhost}' (expired after {} unused, or deleted); keepAlive is false, so queueguard does not re-declare it: the next application declare re-creates it, or set keepAlive: true",
                plan.queue,
                Human(plan.settings.expires)
            ),
        );
    }
    let what = format!("queue '{}' in vhost '{vhost}' already exists with other settings", plan.queue);
    let mut check = refused_check(r, &what);
    if check.reason == Reason::ArgumentsConflict {
        check.message.push_str(". Make the policy match the queue, or move its messages and delete it yourself");
    }
    check
}

fn binding_refusal(plan: &QueuePlan, vhost: &str, r: &Refused) -> Check {
    if let Refused::Broker(r @ Refusal { code: NOT_FOUND, .. }) = r {
        return Check::failed(
            Reason::ExchangeNotFound,
            format!(
                "cannot bind queue '{}': {r}; create the exchange first (queueguard binds to existing exchanges only)",
                plan.queue
            ),
        );
    }
    refused_check(r, &format!("binding queue '{}' in vhost '{vhost}'", plan.queue))
}

/// What deleting a QueuePolicy did on the broker.
#[derive(Debug, Clone, PartialEq)]
pub enum Cleanup {
    /// Everything the policy owned is gone (or was already).
    Deleted(String),
    /// Something still holds messages or consumers, or the broker cannot be reached: retry.
    Blocked(Check),
}

/// deletionPolicy: Delete. Deletes the queue only if it is empty and unused, then the
/// dead-letter queue under the same rule, the dead-letter exchange if nothing else uses it, and
/// the operator's policy. A queue or exchange another QueuePolicy or QueuePattern names
/// (`claims`) stays, whatever it holds: another policy's dead letters still go there.
///
/// For a classic queue the broker checks both atomically (`if-unused`, `if-empty`). Quorum
/// queues refuse those flags, and with a connection-level close (540 NOT_IMPLEMENTED) that would
/// take every other policy's operations on the shared connection with it; for them "empty and
/// unused" is established first (a passive declare's ready messages and consumers, and the
/// management API's unacknowledged messages), and the queue is deleted without flags. The
/// remaining race: a message published or a consumer attached between that check and the
/// delete (one round trip) goes with the queue.
pub async fn delete(plan: &QueuePlan, broker: &Broker, claims: &Claims) -> Cleanup {
    let vhost = broker.vhost().to_owned();
    let mut deleted = Vec::new();
    let mut kept = Vec::new();
    for (what, queue) in [("queue", &plan.queue), ("dead-letter queue", &plan.dead_letter_queue)] {
        if let Some(users) = claims.queue(queue) {
            kept.push(format!("{what} '{queue}' ({} names it)", joined(users)));
            continue;
        }
        let outcome = match delete_queue_if_idle(plan, broker, &vhost, queue).await {
            Err(NotDeleted::Broker(StepError::Lost(_))) => delete_queue_if_idle(plan, broker, &vhost, queue).await,
            other => other,
        };
        match outcome {
            Ok(()) => deleted.push(format!("{what} '{queue}'")),
            Err(NotDeleted::Broker(StepError::Unreachable(msg) | StepError::Lost(msg))) => {
                return Cleanup::Blocked(Check::unknown(Reason::BrokerUnreachable, msg));
            }
            Err(NotDeleted::InUse(detail)) => return Cleanup::Blocked(blocked(queue, &detail)),
            Err(NotDeleted::Broker(StepError::Refused(r))) => {
                return Cleanup::Blocked(refused_check(&r, &format!("deleting queue '{queue}'")));
            }
        }
    }
    let exchange = plan.settings.dead_letter_exchange.as_str();
    match claims.exchange(exchange) {
        Some(users) => kept.push(format!("dead-letter exchange '{exchange}' ({} names it)", joined(users))),
        None => {
            if let Ok(ch) = broker.amqp.channel().await {
                // Another queue may still be bound to the exchange; then it stays.
                let _ = ch
                    .run(ch.exchange_delete(
                        exchange.into(),
                        ExchangeDeleteOptions { if_unused: true, ..Default::default() },
                    ))
                    .await;
            }
        }
    }
    if plan.mode == SettingsMode::Policy
        && let Err(e) = broker.management.delete_policy(&vhost, &plan.policy_name).await
    {
        return Cleanup::Blocked(Check::unknown(Reason::BrokerUnreachable, e.to_string()));
    }
    let mut note = format!("deleted {} and their settings from vhost '{vhost}'", deleted.join(", "));
    if deleted.is_empty() {
        note = format!("deleted the settings of queue '{}' from vhost '{vhost}'", plan.queue);
    }
    if !kept.is_empty() {
        note.push_str(&format!("; kept {}", kept.join(", ")));
    }
    Cleanup::Deleted(note)
}

fn joined(users: &BTreeSet<String>) -> String {
    users.iter().cloned().collect::<Vec<_>>().join(", ")
}

fn blocked(queue: &str, detail: &str) -> Check {
    Check::failed(
        Reason::DeletionBlocked,
        format!(
            "queue '{queue}' is not empty or still has consumers ({detail}); deletionPolicy Delete only removes an empty, unused queue. Drain it, or set deletionPolicy: Retain"
        ),
    )
}

/// Ready messages and consumers from a passive declare (immediate, unlike management statistics).
async fn passive_counts(broker: &Broker, queue: &str) -> Option<(u32, u32)> {
    let ch = broker.amqp.channel().await.ok()?;
    let passive = QueueDeclareOptions { passive: true, ..Default::default() };
    let q = ch.run(ch.queue_declare(queue.into(), passive, FieldTable::default())).await.ok()?;
    Some((q.message_count(), q.consumer_count()))
}

/// Why a queue was not deleted.
enum NotDeleted {
    Broker(StepError),
    /// It holds messages or has consumers (what it holds, said).
    InUse(String),
}

impl From<AmqpError> for NotDeleted {
    fn from(e: AmqpError) -> Self {
        Self::Broker(e.into())
    }
}

async fn delete_queue_if_idle(plan: &QueuePlan, broker: &Broker, vhost: &str, queue: &str) -> Result<(), NotDeleted> {
    let amqp = &broker.amqp;
    // The queue as it is (it may predate the policy), else as the policy declares it.
    let info = broker.management.queue(vhost, queue).await;
    let classic = match &info {
        Ok(Some(q)) => q.queue_type.as_deref().is_none_or(|t| t == "classic"),
        Ok(None) => return Ok(()),
        Err(_) => plan.queue_type == QueueType::Classic,
    };
    let ch = amqp.channel().await?;
    let options = if classic {
        QueueDeleteOptions { if_unused: true, if_empty: true, ..Default::default() }
    } else {
        let unacked = match info {
            Ok(Some(q)) => q.messages_unacknowledged.unwrap_or(0),
            Ok(None) => return Ok(()),
            Err(e) => {
                return Err(NotDeleted::Broker(StepError::Unreachable(format!(
                    "cannot tell whether quorum queue '{queue}' has unacknowledged messages: {e}"
                ))));
            }
        };
        let passive = QueueDeclareOptions { passive: true, ..Default::default() };
        let q = match ch.run(ch.queue_declare(queue.into(), passive, FieldTable::default())).await {
            Ok(q) => q,
            Err(AmqpError::Refused(r)) if r.code == NOT_FOUND => return Ok(()),
            Err(e) => return Err(e.into()),
        };
        if q.message_count() > 0 || q.consumer_count() > 0 || unacked > 0 {
            return Err(NotDeleted::InUse(format!(
                "{} ready messages, {unacked} unacknowledged, {} consumers",
                q.message_count(),
                q.consumer_count()
            )));
        }
        QueueDeleteOptions::default()
    };
    match ch.run(ch.queue_delete(queue.into(), options)).await {
        Ok(_) => Ok(()),
        Err(AmqpError::Refused(r)) if r.code == NOT_FOUND => Ok(()),
        Err(AmqpError::Refused(r)) if r.code == PRECONDITION_FAILED => {
            let detail = match passive_counts(broker, queue).await {
                Some((ready, consumers)) => format!("{ready} ready messages, {consumers} consumers"),
                None => r.text,
            };
            Err(NotDeleted::InUse(detail))
        }
        Err(e) => Err(e.into()),
    }
}
