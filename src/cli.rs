//! The `queueguard` command line.

use crate::{
    broker::{BrokerCredentials, BrokerPool},
    controller, local,
    plan::Limits,
};
use crate::{
    leader::LeaseConfig,
    webhook::{
        certs::SelfSigned,
        server::{CertSource, Webhook},
    },
};
use clap::{Parser, Subcommand, ValueEnum};
use std::{net::SocketAddr, path::PathBuf, process::ExitCode};

#[derive(Parser, Debug)]
#[command(
    name = "queueguard",
    version,
    about = "Keeps RabbitMQ queues and their messages safe across consumer rollouts"
)]
pub struct Cli {
    /// Log format.
    #[arg(long, value_enum, default_value_t = LogFormat::Text, env = "QUEUEGUARD_LOG_FORMAT", global = true)]
    pub log_format: LogFormat,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Run the operator (in-cluster config or KUBECONFIG): watch QueuePolicies, declare their
    /// queues safely, gate rollouts of their consumers and report status; serve /metrics,
    /// /healthz, /readyz and, when asked, the admission webhook.
    Run(RunArgs),
    /// Print the CustomResourceDefinitions as YAML: QueuePolicy (crds/queuepolicy.yaml) and
    /// QueuePattern (crds/queuepattern.yaml), or the one --kind names.
    Crd(CrdArgs),
    /// Local mode, no cluster: reconcile the broker side of every QueuePolicy in FILE and print
    /// each resulting status as YAML. Exit 0 when all are Ready, 1 when any is not, 2 when the
    /// input cannot be read.
    Apply(ApplyArgs),
    /// Change a queue's type live, for a queue no QueuePolicy manages yet: its exchange routes and
    /// messages move to a holding queue, it is deleted and declared again as --to, and routes and
    /// messages move back, with publisher confirms throughout. Keeps its other arguments (those
    /// the new type does not take are named and left behind). Exit 0 when the queue has the new
    /// type, 1 when the migration was refused or stopped (run it again to resume), 2 when the
    /// input is wrong.
    Migrate(MigrateArgs),
    /// List a queue's consumers (tag, peer host, connection name, prefetch, ack mode, since), the
    /// same live view the rollout gate uses; --watch streams attach and detach as JSON lines.
    Consumers(ConsumersArgs),
    /// Rolling restarts of a simulated consumer Deployment against the broker, twice: guarded by
    /// queueguard, and with an auto-delete queue and no gate. Prints published, consumed, lost,
    /// duplicates, queue deletions and the longest gate wait; exit 0 when the guarded run lost
    /// nothing.
    Demo(DemoArgs),
    /// A fault-matrix soak: many guarded rolling restarts and live migrations of one queue
    /// against the broker, with consumers killed without a cancel, slow consumers holding
    /// deliveries, the operator killed mid-rollout and mid-migration, and (with --node-control) a
    /// broker node killed; publishers through an exchange and the default exchange, with
    /// confirms, mandatory, expirations and priorities. Prints one table and a `summary k=v`
    /// line; every message the broker confirmed is accounted for. Exit 0 when none was lost.
    Soak(SoakArgs),
    /// Lint manifests before they reach a cluster: QueuePolicies, QueuePatterns, consumer
    /// Deployments and the queueguard webhook, as `helm template` or `kubectl get -o yaml` print
    /// them.
    ///
    /// Reads every FILE (multi-document YAML, or a `kind: List`; - for stdin) together, so a
    /// QueuePolicy in one file guards a Deployment in another, and reports what would lose messages or
    /// stall rollouts: a policy or pattern the operator refuses, an unsafe rollout strategy, a missing
    /// or never-opening readiness gate, an expiry shorter than a rollout, a dead-letter queue that
    /// expires (another QueuePolicy's queue, or matched by a QueuePattern) or loops, a minAttached that
    /// cannot be met, a pattern not anchored with ^. Each finding names its rule, the object (kind
    /// namespace/name) and says why it is a problem and what to do. Objects without a namespace count
    /// as one namespace; kinds it does not know are skipped.
    #[command(after_long_help = crate::check::output::rules_help())]
    Check(CheckArgs),
    /// Per QueuePolicy in the cluster (kubeconfig, or in-cluster): its queue, depth, consumers
    /// attached against expected, the rollout phase and, for each pod the gate holds, what it
    /// waits for. Installed or linked as `kubectl-queueguard`, this is `kubectl queueguard status`.
    Status(StatusArgs),
    /// Before removing the operator: stop it (--operator-deployment, scaled to zero, waited
    /// for), then remove its finalizer from every QueuePolicy and QueuePattern, so deleting them,
    /// their namespaces or the CRDs never waits for an operator that is gone. Never touches the
    /// broker: every queue stays, and each policy with deletionPolicy Delete is named. Also names
    /// the Deployments whose pod template carries the readiness gate. The chart runs it as a
    /// pre-delete hook.
    Uninstall(UninstallArgs),
}

#[derive(clap::Args, Debug)]
pub struct UninstallArgs {
    /// Only the namespace the operator watches (its `run --namespace`); default: every namespace.
    #[arg(long)]
    pub namespace: Option<String>,
    /// The operator's Deployment, NAMESPACE/NAME: scaled to zero first, so it cannot add the
    /// finalizers back.
    #[arg(long, value_name = "NAMESPACE/NAME", value_parser = namespaced_name)]
    pub operator_deployment: Option<(String, String)>,
    /// How long to wait for the operator's pods to go.
    #[arg(long, default_value = "120s", value_parser = crate::duration::parse)]
    pub wait: std::time::Duration,
    /// Say what would be done, and change nothing.
    #[arg(long)]
    pub dry_run: bool,
}

fn namespaced_name(s: &str) -> Result<(String, String), String> {
    match s.split_once('/') {
        Some((ns, name)) if !ns.is_empty() && !name.is_empty() && !name.contains('/') => {
            Ok((ns.to_owned(), name.to_owned()))
        }
        _ => Err("expected NAMESPACE/NAME".to_owned()),
    }
}

#[derive(clap::Args, Debug)]
pub struct StatusArgs {
    /// Namespace (default: the kubeconfig context's).
    #[arg(short = 'n', long)]
    pub namespace: Option<String>,
    /// Every namespace.
    #[arg(short = 'A', long, conflicts_with = "namespace")]
    pub all_namespaces: bool,
    /// Output format: a table, or a JSON array with one object per policy.
    #[arg(short = 'o', long = "output", value_enum, default_value_t = Output::Table)]
    pub output: Output,
}

#[derive(clap::Args, Debug)]
pub struct CheckArgs {
    /// Manifest files (multi-document YAML or a kind: List), - for stdin.
    #[arg(value_name = "FILE", required = true)]
    pub files: Vec<String>,
    /// Output format: one line per finding, or a JSON array of
    /// {rule, ruleName, severity, kind, namespace, name, message, file}.
    #[arg(short = 'o', long = "output", value_enum, default_value_t = CheckOutput::Text)]
    pub output: CheckOutput,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum CheckOutput {
    Text,
    Json,
}

#[derive(clap::Args, Debug)]
pub struct CrdArgs {
    /// Only this resource's CRD.
    #[arg(long, value_enum)]
    pub kind: Option<CrdKind>,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum CrdKind {
    QueuePolicy,
    QueuePattern,
}

#[derive(clap::Args, Debug)]
pub struct DemoArgs {
    #[command(flatten)]
    pub broker: BrokerArgs,
    /// Rolling restarts per scenario.
    #[arg(long, default_value_t = 10)]
    pub restarts: u32,
    /// Consumer replicas.
    #[arg(long, default_value_t = 2)]
    pub replicas: usize,
    /// Queues each consumer reads, each guarded by a QueuePolicy of its own (a worker with a
    /// command and an event queue, say): a pod is Ready only once it reads every one.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=8))]
    pub queues: u8,
    /// Guarded queues are quorum queues (for a cluster, with --addresses).
    #[arg(long)]
    pub quorum: bool,
    /// The kind of workload the consumers run in: deployment, statefulset (one pod at a time,
    /// no surge), or rollout (an Argo canary Rollout).
    #[arg(long, value_enum, default_value_t = DemoWorkload::Deployment)]
    pub workload: DemoWorkload,
    /// Instead of the two scenarios: the guarded one, whose queues change type live (classic
    /// to quorum; quorum to classic with --quorum) after the first rollout, as `onChange:
    /// Migrate` does, followed by the operator's restart of the workload and the restarts.
    #[arg(long)]
    pub migrate: bool,
}

#[derive(clap::Args, Debug)]
pub struct SoakArgs {
    #[command(flatten)]
    pub broker: BrokerArgs,
    /// Guarded rolling restarts.
    #[arg(long, default_value_t = 20)]
    pub restarts: u32,
    /// Live migrations (classic to quorum and back, in turn), spread among the restarts.
    #[arg(long, default_value_t = 2)]
    pub migrations: u32,
    /// Consumer replicas.
    #[arg(long, default_value_t = 3)]
    pub replicas: usize,
    /// The seed of the fault schedule and of each fault's moment and target: the same seed
    /// replays the same run (default: from the clock, printed).
    #[arg(long)]
    pub seed: Option<u64>,
    /// A command taking `kill-node NODE` and `start-node NODE` (`scripts/rabbitmq-cluster.sh`):
    /// with --nodes, broker nodes are killed and started again during the run.
    #[arg(long, requires = "nodes")]
    pub node_control: Option<String>,
    /// The nodes --node-control knows, comma-separated (qa,qb,qc).
    #[arg(long, value_delimiter = ',', requires = "node_control")]
    pub nodes: Vec<String>,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum DemoWorkload {
    Deployment,
    Statefulset,
    Rollout,
}

impl From<DemoWorkload> for crate::workload::Kind {
    fn from(w: DemoWorkload) -> Self {
        match w {
            DemoWorkload::Deployment => Self::Deployment,
            DemoWorkload::Statefulset => Self::StatefulSet,
            DemoWorkload::Rollout => Self::Rollout,
        }
    }
}

/// Where the broker is, for the commands that talk to one directly.
#[derive(clap::Args, Debug)]
pub struct BrokerArgs {
    /// Broker URI (amqp[s]://user:pass@host:port/vhost).
    #[arg(
        long,
        env = "QUEUEGUARD_BROKER_URI",
        hide_env_values = true,
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2F"
    )]
    pub broker: String,
    /// Management API URI (default: the broker's host on port 15672, same credentials).
    #[arg(long, env = "QUEUEGUARD_MANAGEMENT_URI", hide_env_values = true)]
    pub management: Option<String>,
    /// A cluster's nodes, host:port,host:port,... in the order to try (the URI then gives only
    /// scheme, credentials and vhost); as a Secret's `addresses` key.
    #[arg(long, env = "QUEUEGUARD_BROKER_ADDRESSES")]
    pub addresses: Option<String>,
    /// rabbitmq_prometheus, http[s]://host:port per node, comma separated (default: each
    /// management host on port 15692, 15691 with TLS); as a Secret's `prometheusUri` key.
    #[arg(long, env = "QUEUEGUARD_PROMETHEUS_URI")]
    pub prometheus: Option<String>,
}

impl BrokerArgs {
    fn uri(&self) -> Result<crate::broker::uri::BrokerUri, crate::broker::uri::UriError> {
        crate::broker::uri::BrokerUri::parse_cluster(
            &self.broker,
            self.management.as_deref(),
            self.addresses.as_deref(),
        )?
        .with_prometheus(self.prometheus.as_deref())
    }
}

#[derive(Copy, Clone, Debug, PartialEq, Eq, ValueEnum)]
pub enum Output {
    Table,
    Json,
}

#[derive(clap::Args, Debug)]
pub struct ConsumersArgs {
    /// Queue name.
    pub queue: String,
    /// Virtual host (default: the broker URI's).
    #[arg(long)]
    pub vhost: Option<String>,
    #[command(flatten)]
    pub broker: BrokerArgs,
    /// Output format.
    #[arg(short = 'o', long = "output", value_enum, default_value_t = Output::Table)]
    pub output: Output,
    /// After listing, stream attach and detach as JSON lines until interrupted.
    #[arg(long)]
    pub watch: bool,
}

#[derive(clap::Args, Debug)]
pub struct MigrateArgs {
    /// Queue name.
    pub queue: String,
    /// The type it becomes.
    #[arg(long, value_enum)]
    pub to: TargetType,
    /// Virtual host (default: the broker URI's).
    #[arg(long)]
    pub vhost: Option<String>,
    #[command(flatten)]
    pub broker: BrokerArgs,
    /// Print the plan and change nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// How long the swap waits for the queue's consumers to acknowledge what they hold (they
    /// receive nothing new meanwhile) before it moves everything back and stops.
    #[arg(long, default_value = "60s", value_name = "DURATION", value_parser = crate::duration::parse)]
    pub wait_unacknowledged: std::time::Duration,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum TargetType {
    Classic,
    Quorum,
}

impl From<TargetType> for crate::crd::QueueType {
    fn from(t: TargetType) -> Self {
        match t {
            TargetType::Classic => Self::Classic,
            TargetType::Quorum => Self::Quorum,
        }
    }
}

#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// Watch only this namespace (default: all namespaces).
    #[arg(long, env = "QUEUEGUARD_NAMESPACE")]
    pub namespace: Option<String>,
    /// Act only in these namespaces (comma-separated): QueuePolicies, QueuePatterns, workloads
    /// and pods elsewhere are ignored, as the chart's `rbac.scope: Namespaces` grants writes
    /// only there. Reads stay cluster-wide.
    #[arg(long, env = "QUEUEGUARD_NAMESPACES", value_delimiter = ',', conflicts_with = "namespace")]
    pub namespaces: Vec<String>,
    /// Connection name the broker shows for the operator's AMQP connections.
    #[arg(long, env = "QUEUEGUARD_CONNECTION_NAME", default_value = "queueguard")]
    pub connection_name: String,
    /// Address of /metrics, /healthz and /readyz.
    #[arg(long, env = "QUEUEGUARD_HTTP_ADDR", default_value = "0.0.0.0:8080")]
    pub http_addr: SocketAddr,
    /// Run the controller only while holding a coordination.k8s.io Lease, so that of several
    /// replicas exactly one acts.
    /// Watch the Messaging Topology Operator's Queues (queues.rabbitmq.com): a QueuePolicy for
    /// a queue one of them declares stands back (ManagedElsewhere) unless it says adopt: true.
    #[arg(long, env = "QUEUEGUARD_TOPOLOGY_QUEUES")]
    pub topology_queues: bool,
    #[arg(long, env = "QUEUEGUARD_LEADER_ELECTION")]
    pub leader_election: bool,
    /// Name of the leader Lease.
    #[arg(long, default_value = "queueguard")]
    pub lease_name: String,
    /// Namespace of the leader Lease and of the webhook's certificate Secret (the operator's own).
    #[arg(long, env = "POD_NAMESPACE")]
    pub pod_namespace: Option<String>,
    /// This replica's identity in the Lease.
    #[arg(long, env = "POD_NAME")]
    pub pod_name: Option<String>,
    /// Serve the mutating admission webhook (POST /mutate-pods, TLS) on this address.
    #[arg(long, env = "QUEUEGUARD_WEBHOOK_ADDR")]
    pub webhook_addr: Option<SocketAddr>,
    /// Directory holding tls.crt and tls.key for the webhook (cert-manager's Secret, mounted).
    #[arg(long, requires = "webhook_addr", conflicts_with = "webhook_secret")]
    pub webhook_cert_dir: Option<PathBuf>,
    /// Secret (in the operator's namespace) where the operator keeps its own webhook CA and
    /// certificate, when cert-manager is not used.
    #[arg(long, requires_all = ["webhook_addr", "webhook_service", "webhook_config"])]
    pub webhook_secret: Option<String>,
    /// The webhook's Service name (the certificate's DNS names derive from it).
    #[arg(long)]
    pub webhook_service: Option<String>,
    /// The MutatingWebhookConfiguration whose caBundle the operator keeps.
    #[arg(long)]
    pub webhook_config: Option<String>,
}

impl RunArgs {
    /// The operator's configuration, or the flag mistake that keeps it from starting.
    pub fn config(&self) -> Result<controller::RunConfig, ConfigError> {
        let only: std::collections::BTreeSet<String> =
            self.namespaces.iter().map(|n| n.trim().to_owned()).filter(|n| !n.is_empty()).collect();
        Ok(controller::RunConfig {
            namespace: self.namespace.clone(),
            only_namespaces: (!only.is_empty()).then_some(only),
            connection_name: self.connection_name.clone(),
            http_addr: self.http_addr,
            topology_queues: self.topology_queues,
            lease: self.lease()?,
            webhook: self.webhook()?,
        })
    }

    /// The leader Lease, when leader election is on.
    pub fn lease(&self) -> Result<Option<LeaseConfig>, ConfigError> {
        if !self.leader_election {
            return Ok(None);
        }
        let namespace = self.own_namespace("--leader-election")?;
        let identity = match &self.pod_name {
            Some(name) => name.clone(),
            None => std::env::var("HOSTNAME").map_err(|_| ConfigError::MissingPodName)?,
        };
        Ok(Some(LeaseConfig::new(self.lease_name.clone(), namespace, identity)))
    }

    /// The webhook, when --webhook-addr is given.
    pub fn webhook(&self) -> Result<Option<Webhook>, ConfigError> {
        let Some(addr) = self.webhook_addr else { return Ok(None) };
        let certs = match (&self.webhook_cert_dir, &self.webhook_secret) {
            (Some(dir), _) => CertSource::Dir(dir.clone()),
            (None, Some(secret)) => CertSource::SelfSigned(SelfSigned {
                namespace: self.own_namespace("--webhook-secret")?,
                secret: secret.clone(),
                service: self.webhook_service.clone().unwrap_or_default(),
                webhook_config: self.webhook_config.clone().unwrap_or_default(),
            }),
            (None, None) => return Err(ConfigError::MissingWebhookCertificate),
        };
        Ok(Some(Webhook { addr, certs, timeouts: Default::default() }))
    }

    fn own_namespace(&self, flag: &'static str) -> Result<String, ConfigError> {
        self.pod_namespace.clone().filter(|ns| !ns.is_empty()).ok_or(ConfigError::MissingNamespace { flag })
    }
}

/// What `queueguard run`'s flags and environment lack.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("--leader-election needs this replica's name: set POD_NAME or --pod-name")]
    MissingPodName,
    #[error("{flag} needs the operator's namespace: set POD_NAMESPACE or --pod-namespace")]
    MissingNamespace { flag: &'static str },
    #[error(
        "--webhook-addr needs a certificate: --webhook-cert-dir, or --webhook-secret with --webhook-service and --webhook-config"
    )]
    MissingWebhookCertificate,
}

#[derive(clap::Args, Debug)]
pub struct ApplyArgs {
    /// Manifest file (multi-document YAML), or - for stdin. Secrets in it supply credentials.
    #[arg(short = 'f', long = "filename")]
    pub file: String,
    /// Broker URI for every policy (amqp[s]://user:pass@host:port/vhost), instead of Secrets.
    #[arg(long, env = "QUEUEGUARD_BROKER_URI", hide_env_values = true)]
    pub broker: Option<String>,
    /// Management API URI (default: the broker's host on port 15672, same credentials).
    #[arg(long, env = "QUEUEGUARD_MANAGEMENT_URI", hide_env_values = true)]
    pub management: Option<String>,
    /// With --broker: a cluster's nodes, host:port,host:port,... in the order to try.
    #[arg(long, env = "QUEUEGUARD_BROKER_ADDRESSES", requires = "broker")]
    pub addresses: Option<String>,
    /// With --broker: rabbitmq_prometheus, http[s]://host:port per node (default: each
    /// management host on port 15692, 15691 with TLS).
    #[arg(long, env = "QUEUEGUARD_PROMETHEUS_URI", requires = "broker")]
    pub prometheus: Option<String>,
}

/// The name kubectl runs a plugin by: `kubectl-queueguard` answers `kubectl queueguard ...`.
const KUBECTL_PLUGIN: &str = "kubectl-queueguard";

/// Parses the command line; run as the kubectl plugin, help and errors say `kubectl queueguard`.
fn parse() -> Cli {
    use clap::{CommandFactory, FromArgMatches};
    let invoked = std::env::args_os().next().map(PathBuf::from);
    let as_plugin = invoked.as_deref().and_then(|p| p.file_stem()).is_some_and(|n| n == KUBECTL_PLUGIN);
    let mut command = Cli::command();
    if as_plugin {
        command = command.bin_name("kubectl queueguard");
    }
    Cli::from_arg_matches(&command.get_matches()).unwrap_or_else(|e| e.exit())
}

pub fn main() -> ExitCode {
    let cli = parse();
    // The controller logs its work; one-shot commands speak through their output.
    let default_level = match cli.command {
        Command::Run(_) => "info",
        // The simulated clients' refused channels (an old pod declaring the queue's former
        // type) are part of the demo, counted in its figures: lapin logs each as an error.
        Command::Demo(_) | Command::Soak(_) => "warn,lapin=off",
        _ => "warn",
    };
    init_logging(cli.log_format, default_level);
    crate::tls::install_crypto_provider();
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("tokio runtime");
    runtime.block_on(async move {
        match cli.command {
            Command::Crd(args) => {
                match args.kind {
                    Some(CrdKind::QueuePolicy) => print!("{}", crate::crd::crd_yaml()),
                    Some(CrdKind::QueuePattern) => print!("{}", crate::pattern::crd::crd_yaml()),
                    None => print!("{}{}", crate::crd::crd_yaml(), crate::pattern::crd::crd_yaml()),
                }
                ExitCode::SUCCESS
            }
            Command::Apply(args) => apply(args).await,
            Command::Consumers(args) => consumers(args).await,
            Command::Migrate(args) => migrate_queue(args).await,
            Command::Demo(args) => demo(args).await,
            Command::Soak(args) => soak(args).await,
            Command::Check(args) => check(args),
            Command::Status(args) => status(args).await,
            Command::Uninstall(args) => uninstall(args).await,
            // Flag mistakes first: they need no cluster to be reported.
            Command::Run(args) => match args.config() {
                Err(e) => {
                    tracing::error!(error = %e, "cannot start");
                    ExitCode::FAILURE
                }
                Ok(config) => match controller::run(config).await {
                    Ok(()) => ExitCode::SUCCESS,
                    Err(e) => {
                        tracing::error!(error = %e, "controller stopped");
                        ExitCode::FAILURE
                    }
                },
            },
        }
    })
}

/// The cluster the kubeconfig (or the pod's service account) names; says why not on stderr.
async fn cluster_client() -> Option<kube::Client> {
    crate::kube_api::client()
        .await
        .inspect_err(|e| eprintln!("error: no Kubernetes cluster (KUBECONFIG, ~/.kube/config or in-cluster): {e}"))
        .ok()
}

async fn status(args: StatusArgs) -> ExitCode {
    use crate::overview::{self, Scope};
    let Some(client) = cluster_client().await else { return ExitCode::FAILURE };
    let scope = match (args.all_namespaces, args.namespace) {
        (true, _) => Scope::AllNamespaces,
        (false, Some(ns)) => Scope::Namespace(ns),
        (false, None) => Scope::Namespace(client.default_namespace().to_owned()),
    };
    match overview::list(client, &scope).await {
        Ok(rows) => {
            match args.output {
                Output::Table => print!("{}", overview::table(&rows, k8s_openapi::jiff::Timestamp::now())),
                Output::Json => println!("{}", serde_json::to_string_pretty(&rows).expect("rows serialize")),
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: cannot list QueuePolicies: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn uninstall(args: UninstallArgs) -> ExitCode {
    use crate::uninstall::{Options, run};
    let Some(client) = cluster_client().await else { return ExitCode::FAILURE };
    let options = Options {
        namespace: args.namespace,
        operator: args.operator_deployment,
        wait: args.wait,
        dry_run: args.dry_run,
    };
    match run(client, &options, |line| println!("{line}")).await {
        Ok(_) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn apply(args: ApplyArgs) -> ExitCode {
    let manifest = match local::read_source(&args.file).and_then(|text| local::read_manifest(&args.file, &text)) {
        Ok(m) => m,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    if manifest.policies.is_empty() {
        eprintln!("error: {}: no QueuePolicy found", args.file);
        return ExitCode::from(2);
    }
    let broker = args.broker.map(|uri| BrokerCredentials {
        uri,
        management_uri: args.management,
        ca_cert: None,
        addresses: args.addresses,
        prometheus_uri: args.prometheus,
    });
    let pool = BrokerPool::new("queueguard-apply");
    let results = local::apply(&manifest, broker.as_ref(), &pool, Limits::default()).await;
    for r in &results {
        print!("{}", local::render(r));
    }
    if results.iter().all(|r| r.ready) { ExitCode::SUCCESS } else { ExitCode::from(1) }
}

async fn migrate_queue(args: MigrateArgs) -> ExitCode {
    use crate::migrate::{
        Bounds, Shape, Target, holding_name, plan_text,
        run::{Ended, migrate, plain_declare_note, recorded_target, refusal_on},
    };
    let uri = match args.broker.uri() {
        Ok(uri) => uri,
        Err(e) => {
            eprintln!("error: --broker {e}");
            return ExitCode::from(2);
        }
    };
    let uri = match &args.vhost {
        Some(vhost) => uri.with_vhost(vhost),
        None => uri,
    };
    let pool = BrokerPool::new("queueguard-migrate");
    let broker = match pool.get(uri, None) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let bounds = Bounds { unacknowledged: args.wait_unacknowledged, ..Bounds::default() };
    let vhost = broker.vhost().to_owned();
    let target = match broker.management.queue(&vhost, &args.queue).await {
        Ok(Some(info)) => {
            let current = Shape::of(&info);
            let (target, dropped) = Target::converted(&args.queue, &current, args.to.into());
            let refused = match refusal_on(&broker, &info, &target).await {
                Ok(refused) => refused,
                Err(e) => {
                    eprintln!("error: {e}");
                    return ExitCode::from(1);
                }
            };
            let note = plain_declare_note(&broker, target.queue_type).await;
            print!("{}", plan_text(&vhost, &current, &target, &dropped, refused.as_deref(), &bounds, note.as_deref()));
            if refused.is_some() {
                return ExitCode::from(1);
            }
            target
        }
        // A swap cut off after the deletion: the holding queue has the messages and the target.
        Ok(None) => match recorded_target(&broker, &args.queue).await {
            Ok(Some(target)) => {
                println!(
                    "queue '{}' in vhost '{vhost}' is missing and '{}' holds its messages: resuming the migration to {} that was cut off",
                    args.queue,
                    holding_name(&args.queue),
                    target.shape().describe()
                );
                target
            }
            Ok(None) => {
                eprintln!("error: queue '{}' not found in vhost '{vhost}'", args.queue);
                return ExitCode::from(2);
            }
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::from(1);
            }
        },
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(1);
        }
    };
    if args.dry_run {
        return ExitCode::SUCCESS;
    }
    match migrate(&broker, &target, None, &mut local::Told, &bounds).await {
        Ok(Ended::NotNeeded) => {
            println!("summary migrated=0 moved_out=0 moved_back=0 dropped=0");
            ExitCode::SUCCESS
        }
        Ok(Ended::Moved(state)) => {
            let ms = |v: Option<i64>| v.map_or_else(|| "-".to_owned(), |v| format!("{v} ms"));
            let dropped = state.dropped_at_swap.unwrap_or_default();
            println!(
                "migrated: moved out {}, moved back {}, swap window {}, publishes refused for {}, dropped at the swap {dropped}",
                state.moved_out,
                state.moved_back,
                ms(state.swap_window_millis),
                ms(state.fenced_millis),
            );
            println!("restart the queue's consumers: the swap cancelled them");
            println!(
                "summary migrated=1 moved_out={} moved_back={} dropped={dropped}",
                state.moved_out, state.moved_back
            );
            if dropped > 0 {
                eprintln!(
                    "error: the broker deleted {dropped} messages with the old queue (published to it through the default exchange between the last look and its deletion): they are lost"
                );
                return ExitCode::from(1);
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            eprintln!("nothing was lost: run the same command again to resume (or start again) where it stopped");
            ExitCode::from(1)
        }
    }
}

async fn consumers(args: ConsumersArgs) -> ExitCode {
    use crate::consumers::{QueueKey, Tracking, output, tracker::now_ms};
    let uri = match args.broker.uri() {
        Ok(uri) => uri,
        Err(e) => {
            eprintln!("error: --broker {e}");
            return ExitCode::from(2);
        }
    };
    let queue = QueueKey::new(args.vhost.clone().unwrap_or_else(|| uri.vhost().to_owned()), args.queue.clone());
    let pool = crate::consumers::TrackerPool::new("queueguard-consumers");
    let tracker = match pool.tracker(&uri, None) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut changes = tracker.subscribe();
    let _interest = tracker.watch(queue.clone());
    tracker.wait_synced(&queue.vhost, std::time::Duration::from_secs(15)).await;
    match tracker.tracking_of(&queue) {
        Tracking::Unavailable(why) => {
            eprintln!("error: cannot see the broker: {why}");
            return ExitCode::FAILURE;
        }
        Tracking::Polling(why) if args.watch => eprintln!("note: polling the management API every 2 s ({why})"),
        _ => {}
    }
    // What arrived before the listing is in it; what arrives after is streamed.
    while changes.try_recv().is_ok() {}
    let list = tracker.consumers_on(&queue);
    match args.output {
        Output::Table => print!("{}", output::table(&list)),
        Output::Json => println!("{}", serde_json::Value::Array(list.iter().map(output::to_json).collect())),
    }
    if !args.watch {
        return ExitCode::SUCCESS;
    }
    loop {
        tokio::select! {
            change = changes.recv() => match change {
                Ok(change) if change.queue() == Some(&queue) => {
                    use std::io::Write;
                    let Some(line) = output::watch_line(&change, now_ms()) else { continue };
                    let mut out = std::io::stdout().lock();
                    if writeln!(out, "{line}").and_then(|()| out.flush()).is_err() {
                        return ExitCode::SUCCESS; // the reader went away
                    }
                }
                Ok(_) | Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                Err(_) => return ExitCode::FAILURE,
            },
            _ = tokio::signal::ctrl_c() => return ExitCode::SUCCESS,
        }
    }
}

async fn demo(args: DemoArgs) -> ExitCode {
    use crate::simulation::{self, Scenario};
    let uri = match args.broker.uri() {
        Ok(uri) => uri,
        Err(e) => {
            eprintln!("error: --broker {e}");
            return ExitCode::from(2);
        }
    };
    let mut reports = Vec::new();
    let scenarios: &[bool] = if args.migrate { &[true] } else { &[true, false] };
    for &guarded in scenarios {
        let scenario = Scenario {
            queues: usize::from(args.queues),
            quorum: args.quorum,
            workload: args.workload.into(),
            migrate: args.migrate,
            ..Scenario::new(guarded, args.replicas, args.restarts)
        };
        eprintln!(
            "running: {} ({} replicas, {} queues, {} rolling restarts)",
            scenario.label(),
            args.replicas,
            args.queues,
            args.restarts
        );
        match simulation::run(&scenario, &uri).await {
            Ok(report) => reports.push(report),
            Err(e) => {
                eprintln!("error: {}: {e}", scenario.label());
                return ExitCode::FAILURE;
            }
        }
    }
    print!("{}", simulation::table(&reports));
    let guarded = &reports[0];
    // A gap queueguard reports (RolloutSafe=False) and cannot close is no failure of the gate.
    if let Some(why) = &guarded.unsafe_strategy {
        println!("queueguard reports RolloutSafe=False, UnsafeRolloutStrategy: {why}");
    }
    // Deleting the old queue cancels its consumers: none read the queue from the swap until
    // the restart's first pod attaches (the messages wait in it meanwhile).
    let kept_consumers = match &guarded.migration {
        Some(migration) => {
            println!("{}", migration.line());
            println!(
                "(the swap cancels the old queue's consumers: the queue has none until the restart's pods attach)"
            );
            migration.queue_deletions == u64::from(args.queues)
        }
        None => guarded.fewest_consumers.iter().all(|n| *n > 0) || guarded.unsafe_strategy.is_some(),
    };
    if guarded.lost == 0 && guarded.premature_opens == 0 && guarded.queue_deletions == 0 && kept_consumers {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

async fn soak(args: SoakArgs) -> ExitCode {
    use crate::simulation::soak::{NodeControl, SoakOptions, soak};
    let uri = match args.broker.uri() {
        Ok(uri) => uri,
        Err(e) => {
            eprintln!("error: --broker {e}");
            return ExitCode::from(2);
        }
    };
    let seed = args.seed.unwrap_or_else(|| crate::consumers::tracker::now_ms() as u64);
    let nodes = args.node_control.map(|command| NodeControl { command, nodes: args.nodes });
    let options =
        SoakOptions { seed, restarts: args.restarts, migrations: args.migrations, replicas: args.replicas, nodes };
    eprintln!(
        "soak: seed {seed}, {} restarts, {} migrations, {} replicas, against {}",
        options.restarts,
        options.migrations,
        options.replicas,
        uri.display()
    );
    match soak(&options, &uri).await {
        Ok(report) => {
            print!("{}", report.table());
            println!("{}", report.summary());
            if report.lost == 0 && report.premature_opens == 0 { ExitCode::SUCCESS } else { ExitCode::FAILURE }
        }
        Err(e) => {
            eprintln!("error: soak (seed {seed}): {e}");
            ExitCode::FAILURE
        }
    }
}

fn check(args: CheckArgs) -> ExitCode {
    use crate::check::{self, output};
    let (manifests, findings) = match check::run(&args.files) {
        Ok(result) => result,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    match args.output {
        CheckOutput::Text => {
            print!("{}", output::text(&findings));
            eprintln!("{}", output::summary(&manifests, &findings));
        }
        CheckOutput::Json => println!("{}", output::json(&findings)),
    }
    if findings.is_empty() { ExitCode::SUCCESS } else { ExitCode::from(1) }
}

fn init_logging(format: LogFormat, default_level: &str) {
    use tracing_subscriber::{EnvFilter, fmt};
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new(format!("lapin=warn,kube=warn,{default_level}")));
    // Colours only for a person at a terminal: a file or a log collector gets plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder = fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(ansi);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().flatten_event(true).init(),
    }
}
