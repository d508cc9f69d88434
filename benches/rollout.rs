//! The rollout simulation at 5 replicas and 10 rolling restarts, guarded and, side by side, the
//! auto-delete queue without the gate: how long the gate holds each new pod beyond its own
//! consumer's attach (minAttachedSeconds included, and without it), and messages lost.
//!
//! `cargo bench --bench rollout` against the local broker (QUEUEGUARD_BENCH_BROKER,
//! QUEUEGUARD_BENCH_MANAGEMENT). Ends with one `key=value` summary line.

use queueguard::{
    broker::uri::BrokerUri,
    simulation::{self, Scenario},
};
use std::time::Duration;

fn ms(d: Duration) -> String {
    format!("{:.0}", d.as_secs_f64() * 1000.0)
}

#[tokio::main]
async fn main() {
    queueguard::tls::install_crypto_provider();
    let broker =
        std::env::var("QUEUEGUARD_BENCH_BROKER").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2F".into());
    let management = std::env::var("QUEUEGUARD_BENCH_MANAGEMENT").ok();
    let uri = BrokerUri::parse(&broker, management.as_deref()).expect("broker URI");
    let (replicas, restarts) = (5, 10);
    let guarded = Scenario::new(true, replicas, restarts);
    let min_attached = guarded.min_attached;
    println!(
        "rollout: {replicas} replicas, {restarts} rolling restarts, minAttachedSeconds {}ms",
        min_attached.as_millis()
    );
    let mut reports = Vec::new();
    for scenario in [guarded, Scenario::new(false, replicas, restarts)] {
        reports.push(simulation::run(&scenario, &uri).await.expect("the simulation runs"));
    }
    print!("{}", simulation::table(&reports));
    let g = &reports[0];
    let mut overheads = g.gate_overheads.clone();
    overheads.sort();
    let pick = |p: f64| overheads[((overheads.len() as f64 - 1.0) * p).round() as usize];
    let beyond = |d: Duration| d.saturating_sub(min_attached);
    println!(
        "  gate hold per pod after its consumer attached (n={}): p50={}ms p99={}ms max={}ms; beyond minAttachedSeconds: p50={}ms max={}ms",
        overheads.len(),
        ms(pick(0.5)),
        ms(pick(0.99)),
        ms(pick(1.0)),
        ms(beyond(pick(0.5))),
        ms(beyond(pick(1.0)))
    );
    println!(
        "summary replicas={replicas} restarts={restarts} gated_pods={} gate_extra_p50_ms={} gate_extra_max_ms={} gate_hold_max_ms={} lost={} duplicates={} queue_deletions={} premature_opens={} unguarded_lost={} unguarded_deletions={}",
        overheads.len(),
        ms(beyond(pick(0.5))),
        ms(beyond(pick(1.0))),
        ms(pick(1.0)),
        g.lost,
        g.duplicates,
        g.queue_deletions,
        g.premature_opens,
        reports[1].lost,
        reports[1].queue_deletions
    );
}
