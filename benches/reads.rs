//! What the findings' reads cost the broker, three ways, in one run: per policy (a GET of its
//! queue, one of its dead-letter queue and one of the vhost's consumers, as the operator read
//! before #23), one management listing of the vhost per interval (the management API's
//! statistics), and rabbitmq_prometheus's `/metrics/detailed` beside a listing without
//! statistics. Each round is what one 20 s interval of the findings reads for every policy;
//! the broker's own CPU time over the rounds is read from `/proc/<pid>/stat` of the process
//! listening on the AMQP port, with its idle rate (measured between the paths) subtracted.
//! Paths run in turn, twice (A B C C B A), so drift on a shared machine falls on all.
//!
//! `cargo bench --bench reads` against the local broker (QUEUEGUARD_BENCH_BROKER,
//! QUEUEGUARD_BENCH_MANAGEMENT, QUEUEGUARD_BENCH_PROMETHEUS where the plugin is not on the
//! management host's port 15692; QUEUEGUARD_BENCH_POLICIES, default 500, each a queue and a
//! dead-letter queue; QUEUEGUARD_BENCH_ROUNDS per path and pass, default 5). The broker must
//! run on this machine. Ends with one `key=value` summary line.

use queueguard::{
    broker::{listing::Want, management::ManagementClient, uri::BrokerUri},
    crd::StatsSource,
};
use std::{
    collections::HashSet,
    time::{Duration, Instant},
};

fn env(key: &str, default: &str) -> String {
    std::env::var(key).unwrap_or_else(|_| default.to_owned())
}

/// The pid of the process listening on `port` (its socket's inode among its open files).
fn listener(port: u16) -> Option<u32> {
    let mut inodes = HashSet::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else { continue };
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            let local_port = f.get(1).and_then(|a| a.rsplit(':').next()).and_then(|p| u16::from_str_radix(p, 16).ok());
            if local_port == Some(port) && f.get(3) == Some(&"0A") {
                inodes.insert(format!("socket:[{}]", f[9]));
            }
        }
    }
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(fds) = std::fs::read_dir(entry.path().join("fd")) else { continue };
        for fd in fds.flatten() {
            if std::fs::read_link(fd.path()).is_ok_and(|l| inodes.contains(&*l.to_string_lossy())) {
                return Some(pid);
            }
        }
    }
    None
}

/// The process's user + system CPU time.
fn cpu(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("the broker's /proc stat");
    // Fields after the command (which may hold spaces), 1-based: utime is 14, stime 15.
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<u64> = rest.split_whitespace().map(|x| x.parse().unwrap_or(0)).collect();
    let ticks = f[11] + f[12];
    let hz: u64 = std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(100);
    Duration::from_millis(ticks * 1000 / hz)
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Path {
    PerPolicy,
    Listing,
    Prometheus,
}

impl Path {
    fn name(self) -> &'static str {
        match self {
            Self::PerPolicy => "per-policy GETs (before)",
            Self::Listing => "one listing, management stats",
            Self::Prometheus => "listing + rabbitmq_prometheus",
        }
    }
}

#[derive(Default, Clone, Copy)]
struct Tally {
    rounds: u32,
    wall: Duration,
    cpu: Duration,
    requests: u64,
}

async fn round(path: Path, client: &ManagementClient, vhost: &str, queues: &[(String, String)]) {
    match path {
        Path::PerPolicy => {
            let looks = queues.iter().map(|(q, dlq)| async move {
                client.queue(vhost, q).await.unwrap().expect("the queue");
                client.queue(vhost, dlq).await.unwrap().expect("its dead-letter queue");
                client.consumers_in(vhost).await.unwrap();
            });
            futures::future::join_all(looks).await;
        }
        Path::Listing | Path::Prometheus => {
            let names: Vec<&str> = queues.iter().flat_map(|(q, dlq)| [q.as_str(), dlq.as_str()]).collect();
            let listing = client.queues_in(vhost, Want::Queues(&names), Duration::ZERO).await.unwrap();
            let expected = if path == Path::Prometheus { StatsSource::Prometheus } else { StatsSource::Management };
            assert_eq!(listing.source, expected, "{path:?} reads what it says");
            assert!(queues.iter().all(|(q, _)| listing.queues.contains_key(q)));
        }
    }
}

#[tokio::main]
async fn main() {
    let broker = env("QUEUEGUARD_BENCH_BROKER", "amqp://guest:guest@127.0.0.1:5672/%2F");
    let management = env("QUEUEGUARD_BENCH_MANAGEMENT", "http://127.0.0.1:15672");
    let policies: usize = env("QUEUEGUARD_BENCH_POLICIES", "500").parse().unwrap();
    let rounds: u32 = env("QUEUEGUARD_BENCH_ROUNDS", "5").parse().unwrap();
    let prometheus = std::env::var("QUEUEGUARD_BENCH_PROMETHEUS").ok();
    let uri = BrokerUri::parse(&broker, Some(&management)).unwrap().with_prometheus(prometheus.as_deref()).unwrap();
    let pid = listener(uri.amqp().authority.port).expect("the broker runs on this machine");
    let auto = ManagementClient::new(uri.management().clone(), None).unwrap();
    let plain = ManagementClient::new(uri.management().clone(), None).unwrap().without_prometheus();
    let vhost = format!("qgt-bench-reads-{}", std::process::id());
    let conn = lapin::Connection::connect(&broker, lapin::ConnectionProperties::default()).await.unwrap();
    // A vhost of its own, so the listings hold exactly the bench's queues.
    let http = reqwest::Client::new();
    let api = |path: String| format!("{}/api/{path}", management.trim_end_matches('/'));
    let creds = (uri.management().username.clone(), uri.management().password.clone());
    let put = |path: String, body: serde_json::Value| {
        http.put(api(path)).basic_auth(&creds.0, Some(&creds.1)).json(&body).send()
    };
    put(format!("vhosts/{vhost}"), serde_json::json!({})).await.unwrap().error_for_status().unwrap();
    put(
        format!("permissions/{vhost}/{}", creds.0),
        serde_json::json!({"configure": ".*", "write": ".*", "read": ".*"}),
    )
    .await
    .unwrap()
    .error_for_status()
    .unwrap();
    let mut amqp = uri.amqp().clone();
    amqp.vhost = vhost.clone();
    let vconn = lapin::Connection::connect_uri(amqp, lapin::ConnectionProperties::default()).await.unwrap();
    let ch = vconn.create_channel().await.unwrap();
    let durable = lapin::options::QueueDeclareOptions { durable: true, ..Default::default() };
    let queues: Vec<(String, String)> =
        (0..policies).map(|i| (format!("orders-{i}"), format!("orders-{i}.dlq"))).collect();
    for (q, dlq) in &queues {
        for name in [q, dlq] {
            ch.queue_declare(name.as_str().into(), durable, Default::default()).await.unwrap();
        }
    }
    drop(conn);
    println!("{policies} policies ({} queues) in vhost {vhost}; broker pid {pid}", policies * 2);
    // Statistics published for every queue, and the Prometheus endpoint found (or refused).
    tokio::time::sleep(Duration::from_secs(6)).await;
    let listing = auto.queues_in(&vhost, Want::Pattern("."), Duration::ZERO).await.unwrap();
    let prometheus = listing.source == StatsSource::Prometheus;
    if !prometheus {
        println!(
            "rabbitmq_prometheus does not answer for this broker at {:?}: its path is skipped",
            uri.management().metrics_urls
        );
    }

    // The broker's idle rate, measured between the paths.
    let mut idle = (Duration::ZERO, Duration::ZERO);
    let measure_idle = || async {
        let (c0, t0) = (cpu(pid), Instant::now());
        tokio::time::sleep(Duration::from_secs(3)).await;
        (cpu(pid) - c0, t0.elapsed())
    };
    let mut order = vec![Path::PerPolicy, Path::Listing];
    if prometheus {
        order.push(Path::Prometheus);
    }
    let mut passes = order.clone();
    passes.extend(order.iter().rev());
    let mut tallies = [Tally::default(); 3];
    for path in passes {
        let (c, t) = measure_idle().await;
        idle = (idle.0 + c, idle.1 + t);
        let client = if path == Path::Prometheus { &auto } else { &plain };
        let requests = client.requests() + client.prometheus_requests();
        let (c0, t0) = (cpu(pid), Instant::now());
        for _ in 0..rounds {
            round(path, client, &vhost, &queues).await;
        }
        let tally = &mut tallies[path as usize];
        tally.rounds += rounds;
        tally.wall += t0.elapsed();
        tally.cpu += cpu(pid) - c0;
        tally.requests += client.requests() + client.prometheus_requests() - requests;
    }
    let idle_rate = idle.0.as_secs_f64() / idle.1.as_secs_f64();

    println!(
        "\n{:<32} {:>12} {:>14} {:>18} {:>16} {:>10}",
        "path", "requests", "wall ms", "broker CPU ms", "net CPU ms", "CPU ratio"
    );
    println!("{:<32} {:>12} {:>14} {:>18} {:>16} {:>10}", "(per round, all policies)", "", "", "", "(idle out)", "");
    let net = |t: &Tally| {
        let per_round = |d: Duration| d.as_secs_f64() * 1000.0 / f64::from(t.rounds);
        (per_round(t.cpu) - idle_rate * per_round(t.wall)).max(0.0)
    };
    let base = net(&tallies[Path::PerPolicy as usize]).max(f64::EPSILON);
    let mut summary = vec![format!("policies={policies}"), format!("idle_cpu_per_s_ms={:.1}", idle_rate * 1000.0)];
    for path in order {
        let t = &tallies[path as usize];
        let per_round = |d: Duration| d.as_secs_f64() * 1000.0 / f64::from(t.rounds);
        println!(
            "{:<32} {:>12} {:>14.1} {:>18.1} {:>16.1} {:>10.3}",
            path.name(),
            t.requests / u64::from(t.rounds),
            per_round(t.wall),
            per_round(t.cpu),
            net(t),
            net(t) / base
        );
        let key = format!("{path:?}").to_lowercase();
        summary.push(format!("{key}_requests={}", t.requests / u64::from(t.rounds)));
        summary.push(format!("{key}_cpu_ms={:.1}", net(t)));
    }
    println!(
        "\nAt the findings' 20 s interval that is 3 rounds a minute: per-policy reads cost the broker {:.0} ms CPU a minute for {policies} policies.",
        base * 3.0
    );
    println!("{}", summary.join(" "));
    let delete = http.delete(api(format!("vhosts/{vhost}"))).basic_auth(&creds.0, Some(&creds.1)).send();
    delete.await.unwrap().error_for_status().unwrap();
}
