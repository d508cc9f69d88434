//! queueguard: a Kubernetes operator that keeps RabbitMQ queues, and the messages in them, safe
//! across consumer rollouts.
//!
//! Data flow of one reconcile:
//!
//! ```text
//! QueuePolicy ──plan::plan──▶ QueuePlan ──converge::converge──▶ Outcome ──status::next_status──▶ .status
//!  (crd)        (pure)                     (broker: AMQP declares,          (pure)                 + Events
//!                                            management API policy)
//! ```
//!
//! Decisions are plain functions ([`plan`], [`settings`], [`status`], [`events`]); I/O lives in
//! thin adapters ([`broker`] for RabbitMQ, [`controller`] for Kubernetes).

pub mod broker;
pub mod broker_source;
pub mod check;
pub mod claims;
pub mod cli;
pub mod consumers;
pub mod controller;
pub mod converge;
pub mod crd;
pub mod duration;
pub mod events;
pub mod findings;
pub mod gate;
pub mod http;
pub mod kube_api;
pub mod leader;
pub mod local;
pub mod metrics;
pub mod migrate;
pub mod names;
pub mod overview;
pub mod pass;
pub mod pattern;
pub mod plan;
pub mod rabbitmq_cluster;
pub mod rbac;
pub mod secret;
pub mod settings;
pub mod simulation;
pub mod status;
pub mod sync;
pub mod tls;
pub mod topology;
pub mod uninstall;
pub mod webhook;
pub mod workload;

#[cfg(test)]
mod testing;
