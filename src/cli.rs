//! The `queueguard` command line.

use crate::{
    broker::{BrokerCredentials, BrokerPool},
    controller, local,
    plan::Limits,
};
use clap::{Parser, Subcommand, ValueEnum};
use std::process::ExitCode;

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
    /// Run the controller: watch QueuePolicies (in-cluster config or KUBECONFIG), declare their
    /// queues safely and report status.
    Run(RunArgs),
    /// Print the QueuePolicy CustomResourceDefinition as YAML (what crds/queuepolicy.yaml holds).
    Crd,
    /// Local mode, no cluster: reconcile the broker side of every QueuePolicy in FILE and print
    /// each resulting status as YAML. Exit 0 when all are Ready, 1 when any is not, 2 when the
    /// input cannot be read.
    Apply(ApplyArgs),
}

#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// Watch only this namespace (default: all namespaces).
    #[arg(long, env = "QUEUEGUARD_NAMESPACE")]
    pub namespace: Option<String>,
    /// Connection name the broker shows for the operator's AMQP connections.
    #[arg(long, env = "QUEUEGUARD_CONNECTION_NAME", default_value = "queueguard")]
    pub connection_name: String,
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
}

pub fn main() -> ExitCode {
    let cli = Cli::parse();
    // The controller logs its work; one-shot commands speak through their output.
    let default_level = if matches!(cli.command, Command::Run(_)) {
        "info"
    } else {
        "warn"
    };
    init_logging(cli.log_format, default_level);
    crate::tls::install_crypto_provider();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    runtime.block_on(async move {
        match cli.command {
            Command::Crd => {
                print!("{}", crate::crd::crd_yaml());
                ExitCode::SUCCESS
            }
            Command::Apply(args) => apply(args).await,
            Command::Run(args) => match controller::run(args).await {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    tracing::error!(error = %e, "controller stopped");
                    ExitCode::FAILURE
                }
            },
        }
    })
}

async fn apply(args: ApplyArgs) -> ExitCode {
    let manifest = match local::read_source(&args.file)
        .and_then(|text| local::read_manifest(&args.file, &text))
    {
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
    });
    let pool = BrokerPool::new("queueguard-apply");
    let results = local::apply(&manifest, broker.as_ref(), &pool, Limits::default()).await;
    for r in &results {
        print!("{}", local::render(r));
    }
    if results.iter().all(|r| r.ready) {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

fn init_logging(format: LogFormat, default_level: &str) {
    use tracing_subscriber::{EnvFilter, fmt};
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new(format!("{default_level},lapin=warn,kube=warn")));
    let builder = fmt().with_env_filter(filter).with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().flatten_event(true).init(),
    }
}
