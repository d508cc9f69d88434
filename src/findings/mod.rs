//! Consumer hygiene, judged from live broker data: the habits the source articles name as the
//! ways messages get lost or pile up besides auto-delete. Pure: samples in, verdicts out;
//! what must be remembered between passes (counters, since-when) travels in [`Memory`].

pub mod sample;

use crate::crd::Finding;
use std::time::Duration;

/// One consumer as the broker reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConsumerView {
    pub tag: String,
    pub peer: String,
    pub prefetch: u32,
    pub ack_required: bool,
}

/// What one pass saw of the queue and its dead-letter queue.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Sample {
    pub now_ms: i64,
    pub consumers: Vec<ConsumerView>,
    pub ready: i64,
    pub unacked: i64,
    /// Cumulative counters: since the queue was created (management API message_stats), or per
    /// open channel (Prometheus), so they can go down.
    pub acks: u64,
    pub redeliveries: u64,
    /// Where the counters were read.
    pub source: crate::crd::StatsSource,
    /// When the queue last had activity, if it is idle now.
    pub idle_since_ms: Option<i64>,
    pub dead_letter_ready: Option<i64>,
    /// The operator's own round trip to the broker, for the prefetch suggestion.
    pub round_trip_ms: Option<f64>,
}

/// The policy's settings that findings depend on.
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    pub ignore: Vec<Finding>,
    pub stall_after: Duration,
    pub expires: Duration,
    /// The operator renews the expiry lease itself (keepAlive): then the queue cannot expire.
    pub keep_alive: bool,
}

/// Remembered between passes.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Memory {
    last: Option<Sample>,
    /// Since when unacked messages have sat at the prefetch limit without an ack.
    stalled_since_ms: Option<i64>,
    /// Consecutive passes in which the dead-letter queue grew.
    dead_letter_growth: u32,
}

/// What a pass found: each finding not ignored, present or not, with its message.
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    pub verdicts: Vec<Verdict>,
    pub prefetch: Option<PrefetchAdvice>,
    /// Where the counters judged came from.
    pub source: crate::crd::StatsSource,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Verdict {
    pub finding: Finding,
    /// Some(why and what to do) when the habit is seen.
    pub seen: Option<String>,
}

/// The article 001 formula: (processing + round trip) / processing, per consumer.
#[derive(Debug, Clone, PartialEq)]
pub struct PrefetchAdvice {
    pub suggested: u32,
    pub processing_ms: f64,
    pub round_trip_ms: f64,
}

/// Redeliveries this many times the acks in one interval (and at least MIN_REDELIVERIES) are a
/// message going round and round, not the odd retry.
const REQUEUE_RATIO: u64 = 5;
const MIN_REDELIVERIES: u64 = 10;
/// Passes in a row the dead-letter queue must grow before it is reported.
const GROWTH_PASSES: u32 = 3;

impl Memory {
    /// Whether the last look already saw `now`'s counters (both came from one shared listing of
    /// the vhost): judging it again would find no time passed.
    pub fn has_seen(&self, now: &Sample) -> bool {
        self.last.as_ref().is_some_and(|l| l.now_ms >= now.now_ms)
    }
}

pub fn evaluate(memory: &Memory, now: &Sample, settings: &Settings) -> (Memory, Report) {
    let last = memory.last.as_ref().filter(|l| l.now_ms < now.now_ms);
    // A counter that went down was reset (a channel closed, under Prometheus; the queue
    // recreated): the interval's count is unknown, not zero.
    let acks = last.and_then(|l| now.acks.checked_sub(l.acks));
    let redeliveries = last.and_then(|l| now.redeliveries.checked_sub(l.redeliveries));

    let limit: u64 = now.consumers.iter().map(|c| u64::from(c.prefetch)).sum();
    let bounded = !now.consumers.is_empty() && now.consumers.iter().all(|c| c.ack_required && c.prefetch > 0);
    let at_limit = bounded && now.unacked > 0 && now.unacked as u64 >= limit;
    let stalled_since_ms = match (at_limit, acks) {
        (true, Some(0)) => Some(memory.stalled_since_ms.unwrap_or(last.map_or(now.now_ms, |l| l.now_ms))),
        (true, None) => memory.stalled_since_ms,
        _ => None,
    };
    let dead_letter_growth = match (last.and_then(|l| l.dead_letter_ready), now.dead_letter_ready) {
        (Some(before), Some(after)) if after > before => memory.dead_letter_growth + 1,
        _ => 0,
    };

    let list = |pred: &dyn Fn(&ConsumerView) -> bool| -> String {
        let names: Vec<String> =
            now.consumers.iter().filter(|c| pred(c)).map(|c| format!("'{}' from {}", c.tag, c.peer)).collect();
        names.join(", ")
    };
    let mut verdicts = Vec::new();
    let mut judge = |finding: Finding, seen: Option<String>| {
        if !settings.ignore.contains(&finding) {
            verdicts.push(Verdict { finding, seen });
        }
    };

    judge(
        Finding::StalledConsumers,
        stalled_since_ms.filter(|since| now.now_ms - since >= settings.stall_after.as_millis() as i64).map(|since| {
            format!(
                "{} unacknowledged messages have sat at the consumers' combined prefetch limit ({limit}) with no ack for {}s: a hung worker holds them; restart it or fix what blocks it (its messages are redelivered when its channel closes)",
                now.unacked,
                (now.now_ms - since) / 1000
            )
        }),
    );
    let unbounded = list(&|c| c.ack_required && c.prefetch == 0);
    judge(
        Finding::UnboundedPrefetch,
        (!unbounded.is_empty()).then(|| {
            format!(
                "consumer {unbounded} has prefetch 0 (unlimited): the broker pushes it the whole queue, which can exhaust its memory; set basic.qos prefetch_count per consumer (see status.prefetch for a suggestion). A channel-wide (global) basic.qos also shows as 0 here: global QoS is deprecated, and a channel error on RabbitMQ 4.3"
            )
        }),
    );
    let auto_ack = list(&|c| !c.ack_required);
    judge(
        Finding::AutoAckConsumer,
        (!auto_ack.is_empty()).then(|| {
            format!(
                "consumer {auto_ack} consumes with auto-ack (no_ack): a message is gone the moment it is sent, so a crash loses it; consume with manual acks"
            )
        }),
    );
    judge(
        Finding::RequeueLoop,
        redeliveries
            .zip(acks)
            .filter(|&(r, a)| r >= MIN_REDELIVERIES && r > a.saturating_mul(REQUEUE_RATIO))
            .map(|(r, a)| {
                format!(
                    "{r} redeliveries against {a} acks since the last look: a message is being rejected with requeue=true over and over (a poison message); reject it with requeue=false so it dead-letters"
                )
            }),
    );
    let window = settings.expires.as_millis() as i64;
    let expiry_left = now.idle_since_ms.map(|idle| window - (now.now_ms - idle));
    judge(
        Finding::ExpiryRisk,
        expiry_left
            .filter(|left| !settings.keep_alive && now.ready > 0 && now.consumers.is_empty() && *left < window / 2)
            .map(|left| {
                format!(
                    "{} messages wait with no consumer and the queue expires in about {}s (x-expires {}s): an expired queue drops its messages without dead-lettering them; start a consumer, or set keepAlive",
                    now.ready,
                    left.max(0) / 1000,
                    window / 1000
                )
            }),
    );
    judge(
        Finding::DeadLetterGrowing,
        (dead_letter_growth >= GROWTH_PASSES).then(|| {
            format!(
                "the dead-letter queue has grown {dead_letter_growth} looks in a row, now {} messages: messages keep failing; inspect and replay or discard them",
                now.dead_letter_ready.unwrap_or_default()
            )
        }),
    );

    let prefetch = prefetch_advice(last, now, acks);
    let memory = Memory { last: Some(now.clone()), stalled_since_ms, dead_letter_growth };
    (memory, Report { verdicts, prefetch, source: now.source })
}

/// Processing time per message from the acks of busy consumers (messages were waiting, so they
/// never idled), and the round trip; None until both are known.
fn prefetch_advice(last: Option<&Sample>, now: &Sample, acks: Option<u64>) -> Option<PrefetchAdvice> {
    let last = last?;
    let acks = acks.filter(|a| *a > 0)?;
    let consumers = now.consumers.iter().filter(|c| c.ack_required).count();
    if consumers == 0 || now.ready == 0 || last.ready == 0 {
        return None;
    }
    let elapsed = (now.now_ms - last.now_ms) as f64;
    let processing_ms = elapsed * consumers as f64 / acks as f64;
    let round_trip_ms = now.round_trip_ms?;
    let suggested = ((processing_ms + round_trip_ms) / processing_ms).ceil().max(1.0) as u32;
    Some(PrefetchAdvice { suggested, processing_ms, round_trip_ms })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> Settings {
        Settings {
            ignore: vec![],
            stall_after: Duration::from_secs(180),
            expires: Duration::from_secs(600),
            keep_alive: false,
        }
    }

    fn consumer(tag: &str, prefetch: u32, ack_required: bool) -> ConsumerView {
        ConsumerView { tag: tag.into(), peer: "10.0.0.7".into(), prefetch, ack_required }
    }

    fn seen(report: &Report, finding: Finding) -> Option<&str> {
        report.verdicts.iter().find(|v| v.finding == finding).and_then(|v| v.seen.as_deref())
    }

    fn at(now_ms: i64, edit: impl FnOnce(&mut Sample)) -> Sample {
        let mut o = Sample { now_ms, consumers: vec![consumer("w1", 10, true)], ..Default::default() };
        edit(&mut o);
        o
    }

    #[test]
    fn a_listing_already_judged_is_seen_and_a_newer_one_is_not() {
        let (memory, _) = evaluate(&Memory::default(), &at(20_000, |_| {}), &settings());
        assert!(memory.has_seen(&at(20_000, |_| {})));
        assert!(!memory.has_seen(&at(50_000, |_| {})));
        assert!(!Memory::default().has_seen(&at(20_000, |_| {})));
    }

    /// Runs samples in order, returning the last report.
    fn run(samples: &[Sample], s: &Settings) -> Report {
        let mut memory = Memory::default();
        let mut report = None;
        for o in samples {
            let (m, r) = evaluate(&memory, o, s);
            memory = m;
            report = Some(r);
        }
        report.unwrap()
    }

    #[test]
    fn a_worker_holding_its_prefetch_without_acks_is_stalled_after_stall_after() {
        let stuck = |t: i64| at(t, |o| (o.unacked, o.ready, o.acks) = (10, 50, 7));
        let early = run(&[stuck(0), stuck(60_000)], &settings());
        assert_eq!(seen(&early, Finding::StalledConsumers), None, "one minute is not yet 3m");
        let late = run(&[stuck(0), stuck(60_000), stuck(200_000)], &settings());
        assert!(seen(&late, Finding::StalledConsumers).unwrap().contains("no ack for 200s"));
        let acking = run(&[stuck(0), stuck(100_000), at(200_000, |o| (o.unacked, o.acks) = (10, 9))], &settings());
        assert_eq!(seen(&acking, Finding::StalledConsumers), None, "acks mean progress");
        let below = run(&[stuck(0), at(200_000, |o| (o.unacked, o.acks) = (4, 7))], &settings());
        assert_eq!(seen(&below, Finding::StalledConsumers), None, "below the limit the worker is not full");
    }

    #[test]
    fn prefetch_zero_and_auto_ack_consumers_are_named() {
        let o = at(0, |o| {
            o.consumers = vec![consumer("greedy", 0, true), consumer("fire", 0, false), consumer("ok", 5, true)]
        });
        let r = run(&[o], &settings());
        let unbounded = seen(&r, Finding::UnboundedPrefetch).unwrap();
        assert!(
            unbounded.contains("'greedy'") && !unbounded.contains("'fire'") && !unbounded.contains("'ok'"),
            "{unbounded}"
        );
        let auto = seen(&r, Finding::AutoAckConsumer).unwrap();
        assert!(auto.contains("'fire'") && !auto.contains("'greedy'"), "{auto}");
        let clean = run(&[at(0, |_| {})], &settings());
        assert_eq!((seen(&clean, Finding::UnboundedPrefetch), seen(&clean, Finding::AutoAckConsumer)), (None, None));
    }

    #[test]
    fn redeliveries_far_outpacing_acks_are_a_requeue_loop() {
        let loop_ =
            run(&[at(0, |o| o.redeliveries = 5), at(30_000, |o| (o.redeliveries, o.acks) = (405, 2))], &settings());
        assert!(seen(&loop_, Finding::RequeueLoop).unwrap().contains("400 redeliveries against 2 acks"));
        let retries = run(&[at(0, |_| {}), at(30_000, |o| (o.redeliveries, o.acks) = (12, 900))], &settings());
        assert_eq!(seen(&retries, Finding::RequeueLoop), None, "a few retries among many acks are fine");
        let first = run(&[at(0, |o| o.redeliveries = 1000)], &settings());
        assert_eq!(seen(&first, Finding::RequeueLoop), None, "one look has no interval to compare");
    }

    #[test]
    fn messages_in_an_idle_queue_past_half_its_expiry_are_at_risk_unless_kept_alive() {
        let idle = |idle_for_ms: i64| Sample {
            now_ms: 1_000_000,
            ready: 3,
            idle_since_ms: Some(1_000_000 - idle_for_ms),
            ..Default::default()
        };
        assert!(
            seen(&run(&[idle(400_000)], &settings()), Finding::ExpiryRisk).unwrap().contains("expires in about 200s")
        );
        assert_eq!(seen(&run(&[idle(100_000)], &settings()), Finding::ExpiryRisk), None, "most of the window left");
        let kept = Settings { keep_alive: true, ..settings() };
        assert_eq!(seen(&run(&[idle(400_000)], &kept), Finding::ExpiryRisk), None, "keepAlive renews the lease");
        let empty = Sample { ready: 0, ..idle(400_000) };
        assert_eq!(seen(&run(&[empty], &settings()), Finding::ExpiryRisk), None, "nothing to lose");
    }

    #[test]
    fn a_dead_letter_queue_growing_three_looks_in_a_row_is_reported_and_clears_when_it_stops() {
        let dlq = |t: i64, n: i64| at(t, |o| o.dead_letter_ready = Some(n));
        let growing = [dlq(0, 1), dlq(1, 2), dlq(2, 3), dlq(3, 5)];
        assert!(seen(&run(&growing, &settings()), Finding::DeadLetterGrowing).unwrap().contains("now 5 messages"));
        assert_eq!(seen(&run(&growing[..3], &settings()), Finding::DeadLetterGrowing), None);
        let stopped = [dlq(0, 1), dlq(1, 2), dlq(2, 3), dlq(3, 5), dlq(4, 5)];
        assert_eq!(seen(&run(&stopped, &settings()), Finding::DeadLetterGrowing), None);
    }

    #[test]
    fn ignored_findings_are_not_judged() {
        let s = Settings { ignore: vec![Finding::AutoAckConsumer], ..settings() };
        let r = run(&[at(0, |o| o.consumers = vec![consumer("fire", 0, false)])], &s);
        assert!(r.verdicts.iter().all(|v| v.finding != Finding::AutoAckConsumer));
        assert_eq!(r.verdicts.len(), 5, "the others are still judged");
    }

    #[test]
    fn prefetch_follows_the_article_formula_from_busy_consumers() {
        // Two busy consumers acked 40 messages in 1 s: 50 ms each; with a 10 ms round trip the
        // formula gives (50 + 10) / 50 = 1.2, rounded up to 2.
        let busy = |t: i64, acks: u64| {
            at(t, |o| {
                o.consumers = vec![consumer("a", 1, true), consumer("b", 1, true)];
                (o.ready, o.acks, o.round_trip_ms) = (100, acks, Some(10.0));
            })
        };
        let advice = run(&[busy(0, 0), busy(1000, 40)], &settings()).prefetch.unwrap();
        assert_eq!((advice.suggested, advice.processing_ms, advice.round_trip_ms), (2, 50.0, 10.0));
        let slow_network = |t: i64, acks: u64| at(t, |o| (o.ready, o.acks, o.round_trip_ms) = (100, acks, Some(200.0)));
        let advice = run(&[slow_network(0, 0), slow_network(1000, 20)], &settings()).prefetch.unwrap();
        assert_eq!(advice.suggested, 5, "(50 + 200) / 50");
        let idle = |t: i64, acks: u64| at(t, |o| (o.ready, o.acks, o.round_trip_ms) = (0, acks, Some(10.0)));
        assert_eq!(run(&[idle(0, 0), idle(1000, 20)], &settings()).prefetch, None, "idle consumers say nothing");
    }
}
