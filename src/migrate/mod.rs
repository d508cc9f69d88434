//! A live change of a queue's fixed shape (its type, or the arguments it was declared with),
//! which RabbitMQ cannot make in place. The queue's exchange routes move to a holding queue, its
//! messages follow, the queue is deleted and declared again with its new shape, and routes and
//! messages move back.
//!
//! The broker is the journal. At every moment the queue's bindings together with the holding
//! queue's are the original bindings, and which of the two queues exists, with which shape, says
//! where a migration stopped ([`resume_at`]). `status.migration` records each step before it is
//! taken, for people and for the counts.

pub mod mover;
pub mod run;
mod swap;

use crate::{
    broker::{
        amqp::AmqpError,
        management::{FeatureFlag, ManagementError, PolicyInfo, QueueConsumer, QueueInfo},
    },
    claims::Claims,
    crd::{MigrationPhase, QueueType},
    plan::QueuePlan,
    settings::{self, ArgValue},
};
use serde_json::{Map, Value, json};
use std::{collections::BTreeMap, time::Duration};

/// Above any priority a team gives its own policies: the migration's own policies (the fence,
/// the holding queue's) must apply alone.
const OWN_PRIORITY: i64 = 999_999_999;
const FENCE_PREFIX: &str = "queueguard-fence.";
const HOLDING_POLICY_PREFIX: &str = "queueguard-holding.";
/// Policy keys that decide what becomes of a message while it waits in a queue.
const DEAD_LETTER_KEYS: [&str; 2] = ["dead-letter-exchange", "dead-letter-routing-key"];
/// Operator-policy keys that would refuse, drop or expire what the holding queue holds: an
/// operator policy is merged with ours (the lower limit wins), never outranked.
const LIMITING_KEYS: [&str; 3] = ["max-length", "max-length-bytes", "expires"];

/// AMQP short strings, which carry queue names, hold at most 255 bytes.
const MAX_NAME_BYTES: usize = 255;
const HOLDING_SUFFIX: &str = ".queueguard-migrating";

/// Arguments only classic queues take; quorum queues refuse or ignore them.
const CLASSIC_ONLY: [&str; 4] = ["x-max-priority", "x-queue-mode", "x-queue-version", "x-queue-master-locator"];
/// Arguments only quorum queues take.
const QUORUM_ONLY: [&str; 6] = [
    "x-delivery-limit",
    "x-quorum-initial-group-size",
    "x-max-in-memory-length",
    "x-max-in-memory-bytes",
    "x-dead-letter-strategy",
    "x-queue-leader-locator",
];

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Amqp(#[from] AmqpError),
    #[error(transparent)]
    Management(#[from] ManagementError),
    /// It cannot go ahead; nothing was touched.
    #[error("{0}")]
    Refused(String),
    /// A step failed midway; the next attempt resumes from the broker's state.
    #[error("{0}")]
    Failed(String),
    /// The journal could not record the next step, so it was not taken.
    #[error("could not record the migration before {phase}: {detail}")]
    NotRecorded { phase: &'static str, detail: String },
    /// The queue's consumers still held deliveries when the wait for them ended: the queue was
    /// not deleted (a delivery requeued after it would be lost), and the migration unwound.
    #[error(
        "{unacknowledged} deliveries of queue '{queue}' were still unacknowledged by its consumers after {}s: the queue is not deleted while they could be requeued, so its routes and messages were moved back and it keeps its shape; a consumer that never acknowledges must be restarted",
        waited.as_secs()
    )]
    Unacknowledged { queue: String, unacknowledged: i64, waited: Duration },
    /// Publishes through the default exchange kept reaching the queue: deleting it under them
    /// could lose one, so the migration unwound.
    #[error(
        "publishes through the default exchange kept reaching queue '{queue}' ({publishes} in {}s, each moved on into the holding queue) without a pause of a second: RabbitMQ confirms a publish that reaches a queue as it is deleted and drops it with the queue, so the swap waits for a pause. Its routes and messages were moved back and it keeps its shape: migrate when those publishers pause, or have them publish through an exchange",
        waited.as_secs()
    )]
    Publishing { queue: String, publishes: u64, waited: Duration },
    /// The queue held ready messages and delivered none to the mover for the stall bound.
    #[error(
        "queue '{queue}' held {ready} ready messages and delivered none to queueguard for {}s (a single active consumer, or a broker under flow control, keeps them from it): the migration unwound",
        stalled.as_secs()
    )]
    Stalled { queue: String, ready: u32, stalled: Duration },
}

/// How long a migration waits on others before it unwinds and says why.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bounds {
    /// For the queue's consumers to acknowledge what they hold before the swap (they receive
    /// nothing new meanwhile), and for publishes through the default exchange to pause.
    pub unacknowledged: Duration,
    /// For a queue that holds ready messages to deliver any to the mover.
    pub stall: Duration,
}

impl Default for Bounds {
    fn default() -> Self {
        Self { unacknowledged: Duration::from_secs(60), stall: Duration::from_secs(20) }
    }
}

/// A queue's fixed shape, as the management API lists it.
#[derive(Debug, Clone, PartialEq)]
pub struct Shape {
    pub queue_type: String,
    pub durable: bool,
    pub auto_delete: bool,
    pub exclusive: bool,
    /// Declared arguments, without x-queue-type (which `queue_type` says).
    pub arguments: Map<String, Value>,
}

impl Shape {
    pub fn of(info: &QueueInfo) -> Self {
        let mut arguments = info.arguments.clone();
        let declared = arguments.remove("x-queue-type").and_then(|t| t.as_str().map(str::to_owned));
        Self {
            queue_type: info.queue_type.clone().or(declared).unwrap_or_else(|| "classic".into()),
            durable: info.durable,
            auto_delete: info.auto_delete,
            exclusive: info.exclusive,
            arguments,
        }
    }

    /// `classic {x-max-length: 10}`, as status and the plan print it.
    pub fn describe(&self) -> String {
        let mut text = self.queue_type.clone();
        if !self.durable {
            text.push_str(" transient");
        }
        if self.auto_delete {
            text.push_str(" auto-delete");
        }
        if !self.arguments.is_empty() {
            let args: Vec<String> = self.arguments.iter().map(|(k, v)| format!("{k}: {}", shown(v))).collect();
            text.push_str(&format!(" {{{}}}", args.join(", ")));
        }
        text
    }
}

fn shown(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// What the queue becomes: durable, never auto-delete, with these type and arguments.
#[derive(Debug, Clone, PartialEq)]
pub struct Target {
    pub queue: String,
    pub queue_type: QueueType,
    /// Declared arguments, without x-queue-type.
    pub arguments: Map<String, Value>,
}

impl Target {
    /// The queue as a QueuePolicy declares it.
    pub fn of_queue(plan: &QueuePlan) -> Self {
        Self::from_args(&plan.queue, plan.queue_type, &settings::queue_arguments(plan))
    }

    /// The dead-letter queue as a QueuePolicy declares it.
    pub fn of_dead_letter_queue(plan: &QueuePlan) -> Self {
        Self::from_args(&plan.dead_letter_queue, plan.queue_type, &settings::dead_letter_queue_arguments(plan))
    }

    fn from_args(queue: &str, queue_type: QueueType, args: &BTreeMap<&'static str, ArgValue>) -> Self {
        let arguments = args
            .iter()
            .filter(|(k, _)| **k != "x-queue-type")
            .map(|(k, v)| {
                let value = match v {
                    ArgValue::Long(n) => json!(n),
                    ArgValue::Str(s) => json!(s),
                };
                ((*k).to_owned(), value)
            })
            .collect();
        Self { queue: queue.to_owned(), queue_type, arguments }
    }

    /// The queue's own arguments carried to another type (`queueguard migrate --to`), without
    /// those the new type does not take; returns the ones left behind, for the plan to say.
    pub fn converted(queue: &str, current: &Shape, to: QueueType) -> (Self, Vec<String>) {
        let foreign: &[&str] = match to {
            QueueType::Quorum => &CLASSIC_ONLY,
            QueueType::Classic => &QUORUM_ONLY,
        };
        let mut arguments = current.arguments.clone();
        // Left in, so that the refusal names it: a priority queue cannot become a quorum queue.
        let keep = |k: &str| k == "x-max-priority";
        let dropped: Vec<String> =
            arguments.keys().filter(|k| foreign.contains(&k.as_str()) && !keep(k)).cloned().collect();
        arguments.retain(|k, _| !dropped.contains(k));
        (Self { queue: queue.to_owned(), queue_type: to, arguments }, dropped)
    }

    pub fn shape(&self) -> Shape {
        Shape {
            queue_type: self.queue_type.as_str().to_owned(),
            durable: true,
            auto_delete: false,
            exclusive: false,
            arguments: self.arguments.clone(),
        }
    }

    /// Every argument of the declare, x-queue-type among them.
    pub fn declare_arguments(&self) -> Map<String, Value> {
        let mut args = self.arguments.clone();
        args.insert("x-queue-type".into(), json!(self.queue_type.as_str()));
        args
    }
}

/// How a queue's shape differs from the target's, one `what: now → then` each; empty when the
/// queue already has its target shape.
pub fn differences(current: &Shape, target: &Target) -> Vec<String> {
    let want = target.shape();
    let mut diffs = Vec::new();
    if current.queue_type != want.queue_type {
        diffs.push(format!("type: {} → {}", current.queue_type, want.queue_type));
    }
    if current.durable != want.durable || current.auto_delete != want.auto_delete {
        diffs.push(format!("durable/auto-delete: {}/{} → true/false", current.durable, current.auto_delete));
    }
    let mut keys: Vec<&String> = current.arguments.keys().chain(want.arguments.keys()).collect();
    keys.sort();
    keys.dedup();
    for key in keys {
        let (now, then) = (current.arguments.get(key), want.arguments.get(key));
        if now != then {
            let side = |v: Option<&Value>| v.map(shown).unwrap_or_else(|| "unset".into());
            diffs.push(format!("{key}: {} → {}", side(now), side(then)));
        }
    }
    diffs
}

/// The holding queue of a migration of `queue`.
pub fn holding_name(queue: &str) -> String {
    format!("{queue}{HOLDING_SUFFIX}")
}

/// Why an application's plain declare of the queue (no `x-queue-type`, as most do at start-up)
/// will be refused once it has `to`'s type, on a broker of `version` whose vhost's default queue
/// type is `vhost_default`; None where it will be taken. Measured: RabbitMQ 3.10.8 refuses it for
/// a quorum queue whatever the vhost's default; 4.0.5 reads it as a declare of the vhost's
/// default type, so it refuses it for a queue of any other type.
pub fn plain_declare_refused(to: QueueType, version: Option<&str>, vhost_default: Option<&str>) -> Option<String> {
    let major = version.and_then(|v| v.split('.').next()?.parse::<u32>().ok());
    let default = vhost_default.unwrap_or("classic");
    let to = to.as_str();
    let shown = version.unwrap_or("(version unknown)");
    let consequence = format!(
        "PRECONDITION_FAILED inequivalent arg 'x-queue-type', so consumers that declare it that way stop coming back. They must declare it with x-queue-type: {to} (or passively)"
    );
    match major {
        Some(m) if m >= 4 && to != default => Some(format!(
            "once it is {to}, RabbitMQ {shown} refuses an application's plain declare of it (no x-queue-type, as most do at start-up) in this vhost, whose default queue type is {default}: {consequence}, or the vhost's default queue type must be {to}"
        )),
        Some(m) if m >= 4 => None,
        _ if to == "quorum" => Some(format!(
            "once it is quorum, RabbitMQ {shown} refuses an application's plain declare of it (no x-queue-type, as most do at start-up), whatever the vhost's default queue type (measured on 3.10.8): {consequence}"
        )),
        _ => None,
    }
}

/// Another policy that declares `target.queue` with another shape (a dead-letter queue two
/// policies share, say): migrating it to this policy's shape would have the other migrate it
/// back, at every pass of each.
pub fn shared_conflict(target: &Target, claims: &Claims) -> Option<String> {
    let mine = target.shape().describe();
    let (who, theirs) = claims.shapes.get(&target.queue)?.iter().find(|(_, shape)| **shape != mine)?;
    Some(format!(
        "queue '{}' is also declared by {who}, as {theirs}, and this policy would make it {mine}: each would migrate it back. Give both the same type and arguments for it, or each its own dead-letter queue",
        target.queue
    ))
}

/// What the broker says around a queue, for [`refusal`].
#[derive(Debug, Clone, Copy, Default)]
pub struct Surroundings<'a> {
    /// The broker's feature flags (None where it does not list them).
    pub flags: Option<&'a [FeatureFlag]>,
    /// The queue's consumers, as the management API lists them.
    pub consumers: &'a [QueueConsumer],
    /// The vhost's operator policies.
    pub operator_policies: &'a [PolicyInfo],
}

/// Why a migration from `current` to `target` cannot go ahead, found before anything is
/// touched.
pub fn refusal(current: &Shape, target: &Target, around: &Surroundings) -> Option<String> {
    let queue = &target.queue;
    if current.exclusive {
        return Some(format!(
            "queue '{queue}' is exclusive: it belongs to the connection that declared it and goes with it"
        ));
    }
    if !matches!(current.queue_type.as_str(), "classic" | "quorum") {
        return Some(format!(
            "queue '{queue}' is a {} queue; queueguard migrates classic and quorum queues only",
            current.queue_type
        ));
    }
    if let Some(c) = around.consumers.iter().find(|c| c.exclusive) {
        return Some(format!(
            "queue '{queue}' has an exclusive consumer ('{}'): nobody else can take its messages to move them. Stop that consumer first",
            c.consumer_tag
        ));
    }
    let single_active = current.arguments.get("x-single-active-consumer") == Some(&json!(true));
    if single_active && !around.consumers.is_empty() {
        return Some(format!(
            "queue '{queue}' has a single active consumer: while one is attached ({} are), the queue delivers to nobody else, so its messages cannot be moved. Stop its consumers first",
            around.consumers.len()
        ));
    }
    let quorum = target.queue_type == QueueType::Quorum;
    let priority = |s: &Map<String, Value>| s.get("x-max-priority").cloned();
    if let Some(levels) = priority(&current.arguments)
        && (quorum || priority(&target.arguments) != Some(levels.clone()))
    {
        let why = if quorum {
            "quorum queues have no priorities (the broker refuses x-max-priority on them)"
        } else {
            "the new shape has no x-max-priority"
        };
        return Some(format!(
            "queue '{queue}' is a priority queue (x-max-priority {levels}) and {why}: its messages would lose their priority order. Keep it classic, or move its consumers to a new queue"
        ));
    }
    if quorum && target.arguments.get("x-overflow") == Some(&json!("reject-publish-dlx")) {
        return Some(format!(
            "quorum queues do not support x-overflow reject-publish-dlx (queue '{queue}'); use reject-publish or drop-head"
        ));
    }
    if quorum && let Some(flags) = around.flags {
        let enabled = flags.iter().any(|f| f.name == "quorum_queue" && f.state == "enabled");
        if !enabled {
            return Some(
                "the broker's feature flag quorum_queue is not enabled, so it cannot declare quorum queues: run `rabbitmqctl enable_feature_flag quorum_queue`".into(),
            );
        }
    }
    let holding = holding_name(queue);
    if holding.len() > MAX_NAME_BYTES {
        return Some(format!(
            "queue '{queue}' is too long a name for its holding queue ('{holding}' would pass the broker's 255 bytes)"
        ));
    }
    let (operator, _) = settings::matching_policies(&holding, target.queue_type.as_str(), around.operator_policies);
    if let Some(p) = operator.first()
        && let Some(key) = LIMITING_KEYS.iter().find(|k| p.definition.contains_key(**k))
    {
        return Some(format!(
            "operator policy '{}' applies to the holding queue '{holding}' with {key} {}: it would refuse, drop or expire the messages held there, and no policy outranks an operator policy. Narrow its pattern, or lift that key for the migration",
            p.name,
            shown(&p.definition[*key])
        ));
    }
    None
}

/// What the queue does to a message that waits in it, as policy keys: where it dead-letters
/// (a declared argument wins over the policy that applies) and its message TTL (the lower of the
/// two), RabbitMQ's own rules. The holding queue and the fence do the same.
pub fn waiting_settings(current: &Shape, applying: Option<&PolicyInfo>) -> Map<String, Value> {
    let policy = applying.map(|p| &p.definition);
    let mut waiting = Map::new();
    for key in DEAD_LETTER_KEYS {
        let declared = current.arguments.get(&format!("x-{key}"));
        if let Some(value) = declared.or_else(|| policy.and_then(|d| d.get(key))) {
            waiting.insert(key.into(), value.clone());
        }
    }
    let ttls = [current.arguments.get("x-message-ttl"), policy.and_then(|d| d.get("message-ttl"))];
    if let Some(ttl) = ttls.into_iter().flatten().filter_map(Value::as_i64).min() {
        waiting.insert("message-ttl".into(), json!(ttl));
    }
    waiting
}

/// A priority above every policy of the vhost but the migration's own.
pub fn above(policies: &[PolicyInfo]) -> i64 {
    let top = policies.iter().filter(|p| !is_own(p)).map(|p| p.priority).max().unwrap_or(0);
    OWN_PRIORITY.max(top + 1)
}

/// A policy a migration puts up for itself: a fence, or a holding queue's.
fn is_own(p: &PolicyInfo) -> bool {
    p.name.starts_with(FENCE_PREFIX) || p.name.starts_with(HOLDING_POLICY_PREFIX)
}

/// The holding queue's policy: above every other, so no policy of the vhost shapes what it
/// holds (a length limit, an expiry, a TTL meant for other queues); it dead-letters and expires
/// messages as the queue does (`waiting`). Its overflow also makes an operator policy's limit
/// refuse copies (the mover then stops) rather than drop them.
pub fn holding_policy(queue: &str, waiting: &Map<String, Value>, priority: i64) -> PolicyInfo {
    let mut definition = waiting.clone();
    definition.insert("overflow".into(), json!("reject-publish"));
    PolicyInfo {
        name: holding_policy_name(queue),
        pattern: format!("^{}$", regex::escape(&holding_name(queue))),
        apply_to: "queues".into(),
        priority,
        definition,
    }
}

pub fn holding_policy_name(queue: &str) -> String {
    format!("{HOLDING_POLICY_PREFIX}{queue}")
}

/// The policies that fence a queue while it is swapped, one name per attempt (so statistics
/// that show it were read after this attempt put it up), above every other policy.
#[derive(Debug, Clone, PartialEq)]
pub struct Fence {
    /// Refuses nothing yet: sets the queue's overflow to reject-publish, so that closing the
    /// fence drops nothing. RabbitMQ applies a policy's max-length before its overflow, and under
    /// the default drop-head a length of 0 empties the queue: measured, a one-step fence deleted
    /// every message that reached the queue just before it (3.10.8 and 4.0.5).
    pub ready: PolicyInfo,
    /// Refuses every publish (a publisher with confirms gets a nack and retries), so no message
    /// reaches the queue while the broker deletes it: one routed to it as its deletion runs is
    /// confirmed and dropped with it. None where a declared `x-overflow` would drop instead (an
    /// argument's overflow outranks a policy's): such a queue is swapped unfenced.
    pub closed: Option<PolicyInfo>,
}

pub fn fence(queue: &str, current: &Shape, waiting: &Map<String, Value>, priority: i64, attempt: u64) -> Fence {
    let mut definition = waiting.clone();
    definition.insert("overflow".into(), json!("reject-publish"));
    let ready = PolicyInfo {
        name: format!("{FENCE_PREFIX}{queue}@{attempt}"),
        pattern: format!("^{}$", regex::escape(queue)),
        apply_to: "queues".into(),
        priority,
        definition,
    };
    let declared = current.arguments.get("x-overflow").and_then(Value::as_str);
    let closed = declared.is_none_or(|o| o.starts_with("reject-publish")).then(|| {
        let mut closed = ready.clone();
        closed.definition.insert("max-length".into(), json!(0));
        closed
    });
    Fence { ready, closed }
}

impl Fence {
    /// Whether the queue's statistics were emitted with `policy` of this fence in force: the
    /// ready fence by name, the closed one by its length of 0 too.
    pub fn shown_in(info: &QueueInfo, policy: &PolicyInfo) -> bool {
        let named = info.policy.as_deref() == Some(policy.name.as_str());
        let length = |d: &Map<String, Value>| d.get("max-length").and_then(Value::as_i64);
        let closing = length(&policy.definition) == Some(0);
        named && (!closing || info.effective_policy_definition.as_ref().and_then(length) == Some(0))
    }
}

/// Whether `policy` is a fence of `queue` (of any attempt).
pub fn is_fence_of(policy: &PolicyInfo, queue: &str) -> bool {
    policy.name.starts_with(FENCE_PREFIX) && policy.pattern == format!("^{}$", regex::escape(queue))
}

/// What `queueguard migrate` will do (or, with --dry-run, would), in words: from and to, the
/// arguments the new type does not take, why it cannot go ahead, or the steps.
pub fn plan_text(
    vhost: &str,
    current: &Shape,
    target: &Target,
    dropped: &[String],
    refused: Option<&str>,
    bounds: &Bounds,
    note: Option<&str>,
) -> String {
    let queue = &target.queue;
    let mut lines =
        vec![format!("queue '{queue}' in vhost '{vhost}': {} → {}", current.describe(), target.shape().describe())];
    if !dropped.is_empty() {
        lines.push(format!(
            "  left behind ({} queues do not take them): {}",
            target.queue_type.as_str(),
            dropped.join(", ")
        ));
    }
    if let Some(why) = refused {
        lines.push(format!("  refused: {why}"));
        return lines.join("\n") + "\n";
    }
    if differences(current, target).is_empty() {
        lines.push("  nothing to do: the queue has that shape".into());
        return lines.join("\n") + "\n";
    }
    if let Some(note) = note {
        lines.push(format!("  note: {note}"));
    }
    let holding = holding_name(queue);
    let fenced = fence(queue, current, &Map::new(), 0, 0).closed.is_some();
    let swap = if fenced {
        format!(
            "  4. refuse publishes to '{queue}' for a moment (a policy), delete it once empty and declare it {}",
            target.queue_type.as_str()
        )
    } else {
        format!(
            "  4. delete it once empty and declare it {} (unfenced: its declared x-overflow would drop what a fence refuses, so a publish through the default exchange in that moment can be lost)",
            target.queue_type.as_str()
        )
    };
    lines.extend([
        format!(
            "  1. declare '{holding}' ({}, under a policy of its own that dead-letters and expires as '{queue}' does and limits nothing) and move the exchange routes of '{queue}' to it",
            target.queue_type.as_str()
        ),
        format!("  2. move the messages of '{queue}' into it (publisher confirms; acknowledged once confirmed)"),
        format!(
            "  3. wait until the consumers of '{queue}' hold no unacknowledged delivery (they receive nothing new meanwhile; at most {}s, else move everything back and stop)",
            bounds.unacknowledged.as_secs()
        ),
        swap,
        format!("  5. move the routes and the messages back, and delete '{holding}'"),
        "  then restart the consumers: the swap cancels them, and clients that do not consume again sit idle".into(),
    ]);
    lines.join("\n") + "\n"
}

/// Where a migration stands, read from the broker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resume {
    /// The queue has its target shape and no holding queue is left (or there is no queue at
    /// all, which a plain declare creates): nothing to move.
    NotNeeded,
    /// The queue has another shape and nothing has been moved yet.
    Start,
    /// A migration stopped before this step; resume there.
    At(MigrationPhase),
}

/// The step to take next, from the queue's shape (None: no queue by that name), whether the
/// holding queue exists, and the last step recorded for this target (recorded before it was
/// taken, so every earlier step finished). The broker bounds where a migration can stand; the
/// record says how far within those bounds it got. Every step is safe to take again.
pub fn resume_at(queue: Option<&Shape>, holding: bool, target: &Target, recorded: Option<MigrationPhase>) -> Resume {
    use MigrationPhase::*;
    let reshaped = |q: &Shape| differences(q, target).is_empty();
    let (earliest, latest) = match (queue, holding) {
        (None, false) => return Resume::NotNeeded,
        (Some(q), false) if reshaped(q) => return Resume::NotNeeded,
        (Some(_), false) => return Resume::Start,
        // Routes may be half moved: moving them again is harmless, and the messages follow.
        (Some(q), true) if !reshaped(q) => (Preparing, Swapping),
        (None, true) => (Swapping, Swapping),
        // Also the way back when the spec returned to the old shape midway.
        (Some(_), true) => (Restoring, Refilling),
    };
    Resume::At(recorded.map_or(earliest, |r| r.clamp(earliest, latest)))
}

#[cfg(test)]
mod tests;
